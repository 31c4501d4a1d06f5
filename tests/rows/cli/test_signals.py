"""How a command ends when a signal lands inside library code that turns it into another exception."""

from __future__ import annotations

import argparse
import signal

import pytest

from gradagg.cli import signals


def _wrapped(stop: BaseException) -> None:
    """What Python does to a Ctrl-C inside ``__set_name__`` (seen in matplotlib's import): a RuntimeError from it."""
    try:
        raise stop
    except BaseException as exc:
        raise RuntimeError("Error calling __set_name__ on '_deprecated_property' instance") from exc


@pytest.mark.parametrize(
    ("stop", "status", "line"),
    [(KeyboardInterrupt(), 128 + signal.SIGINT, "gradagg: interrupted\n"),
     (signals.Terminated(signal.SIGTERM), 128 + signal.SIGTERM, "gradagg: stopped by SIGTERM\n")],
)
def test_a_signal_wrapped_in_another_exception_still_ends_as_the_signal(
    stop: BaseException, status: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal that library code wrapped (as cause or context) is still the signal: its one line and 128 + N,
    not a traceback and status 1."""
    assert signals.run(lambda args: _wrapped(stop) or 0, argparse.Namespace()) == status
    assert capsys.readouterr().err == line


def test_an_ordinary_bug_is_not_taken_for_a_signal() -> None:
    """An exception with no signal behind it is not swallowed (a bug stays visible)."""
    def broken(args: argparse.Namespace) -> int:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        signals.run(broken, argparse.Namespace())
