"""The fenced code blocks of README.md and docs/: found, classified, and run (tests/test_docs_blocks.py).

Every block is one of these, and nothing else passes:

- ``python`` with ``>>>`` lines: a doctest, run with ELLIPSIS.
- ``python`` whose first line is ``# fragment: <what it needs>``: compiled, and its ``gradagg`` imports run.
- any other ``python``: saved as a file and run with ``python``; its output must equal the block that follows when
  that one is ````` ```text title="prints" `````, else the ``# comment`` after a final ``print(...)``, if any.
- ``console``: each ``$ command`` runs in bash in a folder holding the repository's ``examples/`` (stdout and
  stderr together, as on a terminal) and must print the lines below it (``...`` matches anything).
- ``text``: a ``title="prints"`` output (checked with the block before it).
- a ``console`` or ``text`` block right after ``<!-- not run: REASON -->`` is not run; one after
  ``<!-- run by: tests/FILE.py::test_name -->`` is run by that test, which must exist.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(```+)\s*(\w*)\s*(.*)$")
MARKER = re.compile(r"^<!-- (not run|run by): (.+?) -->$")
FRAGMENT = "# fragment:"
LANGUAGES = ("python", "console", "text")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and attributes, its text, the marker before it."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    attrs: str
    text: str
    marker: tuple[str, str] | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def prints(self) -> bool:
        return self.lang == "text" and 'title="prints"' in self.attrs

    @property
    def kind(self) -> str:
        """``doctest``, ``fragment``, ``script``, ``console``, ``prints``, ``not run``, ``run by`` or ``unknown``."""
        if self.marker is not None:
            return self.marker[0]
        if self.lang == "python":
            if ">>> " in self.text:
                return "doctest"
            return "fragment" if self.text.startswith(FRAGMENT) else "script"
        if self.lang == "console":
            return "console"
        return "prints" if self.prints else "unknown"


def documents() -> list[Path]:
    """README.md and every page of the documentation site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == m.group(1))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARKER.match(before.strip())
        text = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(path, i + 1, m.group(2), m.group(3), text, (mark.group(1), mark.group(2)) if mark else None))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for p in documents() for b in blocks(p)]


def gradagg_imports(source: str) -> str:
    """The ``import gradagg...`` / ``from gradagg... import`` statements of a block, as a runnable module."""
    tree = ast.parse(source)
    keep = [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("gradagg")]
    keep += [n for n in tree.body if isinstance(n, ast.Import) and any(a.name.startswith("gradagg") for a in n.names)]
    return "\n".join(ast.unparse(n) for n in keep)


def console_steps(text: str) -> list[tuple[str, str]]:
    """``(command, expected output)`` for each ``$ `` line of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    return [(cmd, "\n".join(out) + "\n" if out else "") for cmd, out in steps]


def expected_by_comment(source: str) -> str | None:
    """The comment after a script's final ``print(...)``: what it prints, when no ``prints`` block follows."""
    last = source.rstrip().splitlines()[-1]
    if "print(" in last and "  # " in last:
        return last.rsplit("  # ", 1)[1].strip() + "\n"
    return None
