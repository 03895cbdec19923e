"""griffe extension for the API reference: ``Example:`` is an examples section.

fibrl's docstrings follow the Google style with a singular ``Example:``
heading. griffe reads only ``Examples:`` as an examples section and renders
``Example:`` as a markdown admonition, where doctest output such as
``[1, 2]`` turns into a broken reference link. This extension renames the
heading before griffe parses the docstring, so examples render as code.
"""
from __future__ import annotations

import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Read a Google ``Example:`` heading as ``Examples:``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
