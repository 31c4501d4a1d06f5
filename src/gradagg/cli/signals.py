"""How a command ends: its exit status, the one line it prints, and the signals that stop it.

Every error is one line ``gradagg: error: ...`` on stderr and status 2; a
signal is one line ``gradagg: ...`` and status 128 + its number. SIGTERM and
SIGHUP are turned into an exception (as Ctrl-C is by Python), so that the
``finally`` blocks that remove a temporary output run on every ending.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

from gradagg.errors import GradaggError
from gradagg.options import install_hint

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # as `head`'s writers end: SIGPIPE's status, without the signal's default death


def fail(message: str) -> NoReturn:
    """Print ``message`` as the one error line and exit with status 2."""
    one_line = " ".join(message.split())
    print(f"gradagg: error: {one_line}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def run(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``handler(args)``'s status; every error and signal turned into its one line and status."""
    try:
        return int(handler(args))
    except (KeyboardInterrupt, Terminated) as stop:
        return _stopped(stop)
    except Exception as exc:
        behind = _signal_behind(exc)
        if behind is not None:  # library code turned the signal into its own error (Python's __set_name__ does)
            return _stopped(behind)
        return _failed(exc, args)


def _failed(exc: Exception, args: argparse.Namespace) -> int:
    if isinstance(exc, GradaggError):
        fail(str(exc))
    if isinstance(exc, BrokenPipeError):
        # The reader went away (`gradagg ... | head`): not an input error. Point stdout at
        # /dev/null so Python's flush at exit does not complain, and exit like `head`'s writers do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    where = getattr(args, "file", None)
    if isinstance(exc, OSError):
        # A reader or writer that did not name its file: the input is the best guess left.
        where = exc.filename or where
        fail(f"{where + ': ' if where else ''}{exc.strerror or exc}")
    if isinstance(exc, ImportError):  # an optional package that is missing, where no better message was given
        fail(f"{exc.name or 'a package'} is needed and cannot be imported ({exc}); install it, for example with "
             f"{install_hint('all')}")
    if isinstance(exc, MemoryError):
        fail(f"{where + ': ' if where else ''}out of memory: the input and what it is turned into do not fit in the "
             "memory allowed (ulimit -v, or the machine's); Parquet input is read in batches, text input whole")
    raise exc


def _signal_behind(exc: BaseException) -> BaseException | None:
    """The Ctrl-C or SIGTERM/SIGHUP that ``exc`` was raised from or during, if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (KeyboardInterrupt, Terminated)):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _stopped(stop: BaseException) -> int:
    if isinstance(stop, Terminated):
        print(f"gradagg: stopped by {stop.signal.name}", file=sys.stderr)
        return 128 + stop.signal
    print("gradagg: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the program is so that cleanup runs (a BaseException, like Ctrl-C's)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


def raise_on_termination() -> None:
    """Turn SIGTERM and SIGHUP into :class:`Terminated`, unless the caller set them otherwise (e.g. nohup)."""
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _terminate)


def _terminate(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated(signum)
