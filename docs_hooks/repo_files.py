"""mkdocs hook: links from a page to files of the repository outside ``docs/``.

A page may link to a source file the way it reads on GitHub or in a checkout,
relative to the page (``../examples/pi_estimation.py``,
``../deploy/rbac.yaml``). Such a target is not part of the site, so mkdocs
reports the link as broken. This hook copies every such file that exists into
the site under ``source/`` and points the link there: the built site carries
the files it cites, and a link to a file that does not exist still fails the
strict build.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

PREFIX = "source"
_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def _repo_target(page_uri: str, target: str, docs_dir: Path) -> str | None:
    """The repository-relative path ``target`` names, when it lies outside ``docs/``."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target))
    if not joined.startswith("../"):
        return None
    repo_path = joined[len("../"):]
    if repo_path.startswith("../") or not (docs_dir.parent / repo_path).is_file():
        return None
    return repo_path


def on_files(files, config):
    docs_dir = Path(config["docs_dir"])
    wanted = set()
    for page in files.documentation_pages():
        for _, target, _ in _LINK.findall(Path(page.abs_src_path).read_text()):
            found = _repo_target(page.src_uri, target, docs_dir)
            if found:
                wanted.add(found)
    for repo_path in sorted(wanted):
        files.append(File.generated(config, f"{PREFIX}/{repo_path}",
                                    abs_src_path=str(docs_dir.parent / repo_path)))
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir = Path(config["docs_dir"])

    def relink(match):
        found = _repo_target(page.file.src_uri, match.group(2), docs_dir)
        if found is None:
            return match.group(0)
        rel = posixpath.relpath(f"{PREFIX}/{found}", posixpath.dirname(page.file.src_uri) or ".")
        return f"{match.group(1)}{rel}{match.group(3)}"

    return _LINK.sub(relink, markdown)
