"""The one error hierarchy of gradagg.

Every contract violation is a :class:`GradaggError`, which subclasses
``ValueError`` so that callers who already catch ``ValueError`` keep working.
A message always says *where* (row, column, microbatch, rank) and *what*
(both values involved), e.g. ``"row 17: gradient has length 3, expected 4
(from row 0)"``.
"""

from __future__ import annotations

_SHOWN = 80  # characters of a value shown in a message: one readable line whatever the input holds


class GradaggError(ValueError):
    """Base class of every error gradagg raises for bad input or a broken contract."""


class RowShapeError(GradaggError):
    """A row has the wrong number of fields, or a microbatch the wrong number of values."""


class GradientTypeError(GradaggError):
    """A gradient (or microbatch value) is not a number: a string, a bool, a dict..."""


class GradientShapeError(GradaggError):
    """Vector gradients of one shard differ in length, or a scalar meets a vector."""


class IdError(GradaggError):
    """A shard, worker or owner id is missing (None) or of an unsupported type."""


class UnorderableShardError(GradaggError):
    """Two shard ids cannot be ordered against each other (e.g. ``1`` and ``"a"``)."""


class NumberRangeError(GradaggError):
    """A sum or mean is outside what a float can hold (e.g. a 400-digit integer met by a float)."""


class NonFiniteGradientError(GradaggError):
    """A counted gradient is NaN or infinite and the caller asked for an error."""


class FormatError(GradaggError):
    """An input file cannot be parsed in the chosen format."""


class OutputError(GradaggError):
    """The result cannot be written: where ``-o`` points, or in the chosen output format."""


class CollectiveError(GradaggError):
    """Ranks of a process group disagree, or a collective failed or timed out."""


class WindowError(GradaggError):
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


class PlacementError(GradaggError):
    """A DTensor's placement or mesh cannot be counted exactly once (e.g. ``Partial``)."""


class ScriptError(GradaggError):
    """A user's script cannot be used for a parity check (a missing function, a bad layout)."""


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


TORCH_HINT = ("pip install 'gradagg[torch]' (on Linux that is a CUDA build of about 2 GB; for the CPU one, first "
              "pip install torch --index-url https://download.pytorch.org/whl/cpu)")


def require_torch(what: str) -> None:
    """Raise a one-line :class:`GradaggError`, ``what`` and the install hint, when torch cannot be imported."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise GradaggError(f"{what} needs torch: {TORCH_HINT}") from None
