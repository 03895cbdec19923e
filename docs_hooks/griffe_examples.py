"""griffe extension for the API reference: docstrings written for Sphinx habits
render as markdown.

- ``Example:`` is an examples section. fibrl's docstrings follow the Google
  style with a singular ``Example:`` heading. griffe reads only ``Examples:`` as
  an examples section and renders ``Example:`` as a markdown admonition, where
  doctest output such as ``[1, 2]`` turns into a broken reference link. The
  heading is renamed before griffe parses the docstring, so examples render as
  code.
- Sphinx roles (``:class:`X```, ``:meth:`~a.b```, ``:func:``...) mean nothing to
  markdown and would show as raw text: each becomes the code span ```X```
  (a leading ``~`` keeps the last dotted part, as in Sphinx).
"""
from __future__ import annotations

import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|exc|mod|data|obj|const):`(~?)([^`]+)`")


def _code_span(match: re.Match) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def markdown_docstring(text: str) -> str:
    """``text`` with its ``Example:`` headings and Sphinx roles rewritten."""
    return _ROLE.sub(_code_span, _HEADING.sub(r"\1Examples:", text))


class ExampleSections(griffe.Extension):
    """Read a Google ``Example:`` heading as ``Examples:`` and Sphinx roles as code."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
