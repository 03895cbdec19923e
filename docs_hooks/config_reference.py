"""mkdocs hook: the configuration reference, generated from ``fibrl.config.Config``.

A page that contains the line ``<!-- fibrl:config-reference -->`` gets, in its
place, one table row per field of the ``Config`` dataclass: the key (also the
``.fibrlconfig`` key) with its environment variable, the default with its type,
and the field's docstring. Three columns, so that the table fits the page's
width (docs/css/fibrl.css lets a long default wrap inside its cell). Types and
defaults come from the dataclass itself, docstrings (the string literal under
each field) from its source, so the page follows the code and cannot drift.
A field without a docstring fails the build: every key must be documented.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import typing
from pathlib import Path

MARKER = "<!-- fibrl:config-reference -->"


def _import_config(repo_root: Path):
    """Import ``fibrl.config`` from this checkout, not from an installed copy."""
    root = str(repo_root)
    if root not in sys.path:
        sys.path.insert(0, root)
    module = importlib.import_module("fibrl.config")
    found = Path(module.__file__).resolve()
    if repo_root.resolve() not in found.parents:
        raise RuntimeError(
            f"the configuration reference would be built from {found}, not from the checkout "
            f"at {repo_root}: another fibrl was imported first. Run mkdocs from the checkout "
            f"in a fresh interpreter.")
    return module


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of ``cls``'s class body."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def reference_table(module) -> str:
    """The markdown table of every config key of ``module.Config``."""
    config = module.Config
    hints = typing.get_type_hints(config)
    docs = field_docs(config)
    rows = ["| key and environment variable | default (type) | description |",
            "|---|---|---|"]
    for field in dataclasses.fields(config):
        if field.name not in docs:
            raise RuntimeError(
                f"fibrl.config.Config.{field.name} has no docstring: add a string literal "
                f"under the field saying what it sets; the configuration reference is built "
                f"from them.")
        kind = getattr(hints[field.name], "__name__", str(hints[field.name]))
        rows.append(f"| `{field.name}`<br>`{module.ENV_PREFIX}{field.name.upper()}` | "
                    f"`{field.default!r}` (`{kind}`) | {_cell(docs[field.name])} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    module = _import_config(Path(config["config_file_path"]).parent)
    return markdown.replace(MARKER, reference_table(module))
