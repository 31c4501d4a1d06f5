"""The one error hierarchy of gradagg.

Every error gradagg raises is a :class:`GradaggError`: ``except GradaggError`` catches them all. Two kinds:

* a broken contract or bad input, of a named kind, is a :class:`ContractError` subclass (``RowShapeError``,
  ``WindowError``, ...), also a ``ValueError``, so that callers who already catch ``ValueError`` keep working;
* a :class:`CollectiveError` (a peer rank died, a collective timed out, the ranks of a group disagree) is *not* a
  ``ValueError``: an ``except ValueError`` around a training step must not swallow a dead rank (the other ranks
  would wait for it until their own timeout).

A plain ``GradaggError`` (raised as is for bad input without a kind of its own) is not a ``ValueError`` either.
A message always says *where* (row, column, microbatch, rank) and *what* (both values involved), e.g.
``"row 17: gradient has length 3, expected 4 (from row 0)"``.

>>> issubclass(WindowError, ValueError), issubclass(CollectiveError, ValueError)
(True, False)
"""

from __future__ import annotations

_SHOWN = 80  # characters of a value shown in a message: one readable line whatever the input holds


class GradaggError(Exception):
    """Base class of every error gradagg raises (bad input, a broken contract, a failed collective)."""


class ContractError(GradaggError, ValueError):
    """Base class of the named contract violations and bad inputs: each is also a ``ValueError``."""


class RowShapeError(ContractError):
    """A row has the wrong number of fields, or a microbatch the wrong number of values."""


class GradientTypeError(ContractError):
    """A gradient (or microbatch value) is not a number: a string, a bool, a dict..."""


class GradientShapeError(ContractError):
    """Vector gradients of one shard differ in length, or a scalar meets a vector."""


class IdError(ContractError):
    """A shard, worker or owner id is missing (None) or of an unsupported type."""


class UnorderableShardError(ContractError):
    """Two shard ids cannot be ordered against each other (e.g. ``1`` and ``"a"``)."""


class NumberRangeError(ContractError):
    """A sum or mean is outside what a float can hold (e.g. a 400-digit integer met by a float)."""


class NonFiniteGradientError(ContractError):
    """A counted gradient is NaN or infinite and the caller asked for an error."""


class FormatError(ContractError):
    """An input file cannot be parsed in the chosen format."""


class OutputError(ContractError):
    """The result cannot be written: where ``-o`` points, or in the chosen output format."""


class CollectiveError(GradaggError):
    """Ranks of a process group disagree, or a collective failed or timed out (a peer died).

    Not a ``ValueError``: code that catches ``ValueError`` for its own reasons must not swallow a dead rank.
    """


class WindowError(ContractError):
    """An accumulation window is in a state that forbids the requested step.

    ``reason`` is what went wrong; ``remedy``, when given, what the caller should do next: the message is
    both (``"reason; remedy"``), and a wrapper that does the remedy itself reports ``reason`` alone.

    >>> e = WindowError("rank 1 failed", remedy="call discard() on every rank")
    >>> str(e), e.reason
    ('rank 1 failed; call discard() on every rank', 'rank 1 failed')
    """

    def __init__(self, reason: str, *, remedy: str | None = None) -> None:
        super().__init__(reason if remedy is None else f"{reason}; {remedy}")
        self.reason = reason
        self.remedy = remedy


class PlacementError(ContractError):
    """A DTensor's placement or mesh cannot be counted exactly once (e.g. ``Partial``)."""


class ScriptError(ContractError):
    """A user's script cannot be used for a parity check (a missing function, a bad layout)."""


class PrecisionWarning(UserWarning):
    """A setting under which gradagg's result is exact only within a lower precision's round-off than the window's
    float32 sums (named, with the setting that keeps them): warned once, at construction."""


def short_repr(value: object) -> str:
    """``repr(value)`` for a message, cut to 80 characters.

    >>> short_repr("x" * 100)[-6:]
    'xxx...'
    """
    try:
        text = repr(value)
    except ValueError:  # an int (or a list holding one) beyond Python's digit limit for text
        big = value if isinstance(value, int) else None
        text = f"<an int of about {int(big.bit_length() * 0.30103) + 1} digits>" if big else "<too long to show>"
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (backend errors run long), or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def last_line(text: str | None) -> str:
    """The last non-blank line of a traceback (the exception), or ``"failed"``.

    >>> last_line("Traceback ...\\n  File x\\nValueError: bad\\n")
    'ValueError: bad'
    """
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "failed"


# gradagg is not on PyPI: the hint installs from a clone (as options.install_hint does for the other extras).
TORCH_HINT = ("pip install -e '.[torch]' in a clone of gradagg (it is not on PyPI; on Linux that pulls a CUDA build "
              "of torch of about 2 GB: for the CPU one, first pip install torch --index-url "
              "https://download.pytorch.org/whl/cpu)")


def require_torch(what: str) -> None:
    """Raise a one-line :class:`GradaggError`, ``what`` and the install hint, when torch cannot be imported."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise GradaggError(f"{what} needs torch: {TORCH_HINT}") from None
