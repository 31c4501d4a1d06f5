"""The child process of ``gradagg verify --impl``: import the user's function, answer each call, judge nothing.

This file is run as the child's program text (``python -c``), not imported there, and it imports
only the standard library: nothing of :mod:`gradagg.verify` is loaded in the child unless the user's
module loads it itself, and then replacing its functions changes nothing that runs here. The child
receives only the arguments of each check, over a pipe the parent created; it sends back, over a
second pipe, ``{"case": k, "ok": ..., "value": ...}`` per call, as plain JSON. The expected values
stay in the parent, which judges (:mod:`gradagg.verify.isolate`).

The parent imports :func:`plain` from here, so that both sides turn results into plain data alike.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any


def plain(value: Any) -> Any:
    """``value`` as plain JSON-able data: lists, ``int``, ``float``, ``str``, ``bool``, ``None``.

    Subclasses become their base type (NumPy's float64 is a float); anything else
    becomes ``{"unrepresentable": description}``, which equals no expected value.

    >>> plain((1, [2.5, None]))
    [1, [2.5, None]]
    """
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value) if value.bit_length() < 14_000 else {"unrepresentable": "an int of over 4200 digits"}
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return {"unrepresentable": f"{type(value).__name__} {short_repr(value)}"}


def short_repr(value: Any) -> str:
    """``repr(value)``, at most 80 characters, or what stopped it (a user's object may fail even to print)."""
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<repr raised {type(exc).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def main(spec: str, requests_fd: int, answers_fd: int) -> None:
    """Read every request, import ``spec``, answer each request in order; then end the process at once."""
    with os.fdopen(requests_fd, "r", encoding="utf-8") as f:
        requests = f.read().splitlines()  # all of it before the user's module runs
    out = os.fdopen(answers_fd, "w", encoding="utf-8")
    dumps, loads, to_plain = json.dumps, json.loads, plain  # bound now: the user's module may replace json's

    def send(record: dict[str, Any]) -> None:
        out.write(dumps(record) + "\n")
        out.flush()

    try:
        impl = load(spec)
    except ImportProblem as exc:
        send({"import_error": str(exc)})
    else:
        send({"imported": True})
        for k, request in enumerate(requests):
            try:
                record = {"case": k, "ok": True, "value": to_plain(impl(*loads(request)))}  # a fresh copy each call
            except (Exception, SystemExit) as exc:  # a user's function may fail in any way: that check fails
                record = {"case": k, "ok": False, "value": f"raised {type(exc).__name__}: {exc}"}
            send(record)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not sys.exit: threads or exit hooks the implementation left behind must not keep the child alive


class ImportProblem(Exception):
    """``spec`` cannot be imported, or is not a function: the parent raises it as a usage error."""


def load(spec: str) -> Any:
    """Import ``MODULE:FUNCTION`` from the current folder first (also under ``PYTHONSAFEPATH``)."""
    module_name, _, attr = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:
        raise ImportProblem(f"importing module {module_name!r} called sys.exit({exc.code!r})") from None
    except Exception as exc:  # any error raised by the user's module while it is imported
        raise ImportProblem(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, attr):
        raise ImportProblem(f"module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ImportProblem(f"{attr!r} is a {type(fn).__name__}, not a function")
    return fn


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
