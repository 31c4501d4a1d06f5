"""A griffe extension for the API reference: a docstring's bare ``>>>`` examples become ``pycon`` code blocks.

The docstrings put their doctests after the Args/Returns/Raises sections, with no "Examples:" heading (the tests
run them as doctests). Without a fence, Markdown would read them as prose: ``[[1, 2]]`` as a link reference.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence(text: str) -> str:
    """Each run of lines from a ``>>>`` line to the next blank line, fenced as ``pycon`` at its indentation."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctests of every object's docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence(obj.docstring.value)
