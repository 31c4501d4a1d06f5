"""What must hold before a local world starts: the caller's ``__main__`` can be re-imported by each rank.

Each rank (a forkserver process) imports the parent's main script again, as ``__mp_main__``, so that
the worker named by module can be found; a call at the script's top level, outside
``if __name__ == "__main__":``, would then start a world inside every rank, which multiprocessing
refuses with a long traceback from each of them. :func:`check_main_guard` refuses it up front, once.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from gradagg.errors import CollectiveError, GradaggError


def check_main_guard() -> None:
    """Raise when this call runs at the top level of the main script, outside ``if __name__ == "__main__":``.

    Raises:
        GradaggError: it does; the message names the script's line and says to add the guard.
        CollectiveError: ``__main__`` claims a file that does not exist (ranks could not import it).
    """
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main is None or main_file is None:
        return  # interactive, or python -c: nothing for the ranks to re-import
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if name == "__main__" or name.endswith(".__main__"):
        return  # python -m package: multiprocessing does not re-import a package's __main__ in the ranks
    if not os.path.exists(main_file):
        raise CollectiveError(f"cannot start ranks from a __main__ that is not a file ({main_file!r}); run a script")
    line = _top_level_line(sys._getframe(1), vars(main))
    if line is not None and not _guarded(main_file, line):
        raise GradaggError(f"{main_file} line {line}: a local world is started at the script's top level; put the "
                           "call under `if __name__ == \"__main__\":` (each rank imports the script again, and "
                           "would start a world of its own)")


def _top_level_line(frame: FrameType | None, main_globals: dict[str, Any]) -> int | None:
    """The line of the main script's top-level code that this call comes from, if it comes from there."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main_globals:
            return frame.f_lineno
        frame = frame.f_back
    return None


def _guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script lies inside an ``if __name__ == "__main__":`` block (unreadable: assume so)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return True
    return any(_is_main_test(node.test) and node.lineno <= line <= (node.end_lineno or node.lineno)
               for node in ast.walk(tree) if isinstance(node, ast.If))


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def reference(fn: Callable[..., Any]) -> tuple[str, str]:
    """``(module, qualified name)`` by which a rank imports the worker ``fn``.

    Raises:
        CollectiveError: ``fn`` is a lambda, a local function, or lives in an interactive ``__main__``.
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        if main_file is None:
            raise CollectiveError(f"worker {qualname!r} lives in an interactive __main__; move it to a module")
        module = Path(main_file).stem  # run by path: the script's folder is sys.path[0] in every rank
    if module is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise CollectiveError(f"worker {qualname!r} must be a module-level function of an importable module")
    return module, qualname
