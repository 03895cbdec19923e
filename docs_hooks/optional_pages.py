"""mkdocs hook: pages listed under ``extra.optional_nav`` join the nav once they exist.

Pages that other parts of the project add (the security model, the RL guides,
the architecture) are named in ``mkdocs.yml`` under ``extra.optional_nav``,
section title -> list of files. Each one that exists in ``docs/`` is appended
to that nav section (created after the guides if the nav has none), and one
that does not is left out, so the build neither breaks before the page exists
nor forgets it after.
"""
from __future__ import annotations

from pathlib import Path


def _section(nav: list, title: str, after: str) -> list:
    for entry in nav:
        if isinstance(entry, dict) and title in entry:
            return entry[title]
    position = next((i + 1 for i, entry in enumerate(nav)
                     if isinstance(entry, dict) and after in entry), len(nav))
    pages: list = []
    nav.insert(position, {title: pages})
    return pages


def on_config(config):
    docs_dir = Path(config["docs_dir"])
    wanted = (config["extra"] or {}).get("optional_nav") or {}
    nav = config["nav"]
    listed = {str(page) for entry in nav for page in _pages(entry)}
    for title, files in wanted.items():
        present = [name for name in files
                   if (docs_dir / name).is_file() and name not in listed]
        if present:
            _section(nav, title, after="Guides").extend(present)
    return config


def _pages(entry):
    if isinstance(entry, str):
        yield entry
    elif isinstance(entry, dict):
        for value in entry.values():
            yield from (_pages(value) if isinstance(value, (list, dict)) else [value])
    elif isinstance(entry, list):
        for item in entry:
            yield from _pages(item)
