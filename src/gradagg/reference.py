"""The two contracts of gradagg, in pure Python: the oracle every fast path is tested against.

Vocabulary (used the same way everywhere in gradagg):

shard
    A piece of the model's gradient with its own id: a parameter, a slice of
    one, an expert. Shard ids are ``int`` or ``str``.
worker
    The process (rank) that produced a row. Several workers may hold a copy
    of the same shard.
owner
    The one worker designated to contribute a shard's gradient. Declared,
    never guessed.
replica
    A copy of a shard held by a worker that is not its owner. A replica's
    gradient may be stale; it is never counted.
microbatch
    One forward/backward pass inside an accumulation window. M is the number
    of microbatches actually run.
absent
    A parameter that received no gradient in a microbatch (``None``). It
    contributes zero to the sum and is still counted in the divisor. Absent
    is not zero (a value someone computed) and not NaN (a broken value).
participation
    In how many microbatches a parameter was present. Reported, never used as
    a divisor.
divisor
    What a sum is divided by to make a mean: here always M, the counted
    number of microbatches.

Contract 1, owner-only shard reduction (:func:`owner_sum`): rows
``(shard_id, worker_id, owner_id, gradient)``; only rows whose worker equals
their owner contribute; an owner's contributions add; the result is
``[[shard, total], ...]`` sorted by shard, and a shard with no owner row does
not appear.

Contract 2, microbatch accumulation weighting (:func:`microbatch_mean`):
``result[j] = sum_i (rows[i][j] or 0) / M``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias

from gradagg.errors import (
    GradientShapeError,
    GradientTypeError,
    IdError,
    NonFiniteGradientError,
    NumberRangeError,
    RowShapeError,
    UnorderableShardError,
    short_repr,
)
from gradagg.options import NonFinite, check_nonfinite

Number: TypeAlias = int | float
Gradient: TypeAlias = Number | list[Number]
ShardId: TypeAlias = int | str

_ID_FIELDS = ("shard_id", "worker_id", "owner_id")


def owner_sum(rows: Sequence[Sequence[object]], *, nonfinite: NonFinite = "propagate") -> list[list[object]]:
    """Sum each shard's gradient over the rows its owner contributed.

    Args:
        rows: ``(shard_id, worker_id, owner_id, gradient)`` rows in any order.
            A gradient is an int, a float or a list of numbers (a vector
            gradient, summed element-wise).
        nonfinite: ``"propagate"`` (default) lets a counted NaN or Inf flow into
            the total; ``"raise"`` makes it an error. Uncounted replica rows
            never affect the result, so they are never checked for finiteness.

    Returns:
        ``[[shard_id, total], ...]`` sorted by shard id. Integer totals stay
        exact integers; float totals are summed in row order.

    Raises:
        GradaggError: a subclass naming the row and the values at fault.

    >>> owner_sum([["x", "a", "a", 1], ["x", "b", "a", 9], ["y", "c", "c", 2]])
    [['x', 1], ['y', 2]]
    """
    check_nonfinite(nonfinite)
    _check_rows(rows, "rows")
    totals: dict[ShardId, Gradient] = {}
    shapes: dict[ShardId, tuple[int | None, int]] = {}  # shard -> (vector length, first row)
    for r, row in enumerate(rows):
        shard, worker, owner, gradient = _check_row(r, row)
        _check_shape(r, shard, gradient, shapes)
        if worker != owner:
            continue  # a replica: held, maybe stale, never counted
        if nonfinite == "raise":
            _check_finite(gradient, f"row {r}: gradient of shard {short_repr(shard)}")
        totals[shard] = gradient if shard not in totals else _add(r, shard, totals[shard], gradient)
    return [[shard, totals[shard]] for shard in _sorted_shards(totals, shapes)]


def microbatch_mean(
    rows: Sequence[Sequence[object]],
    active_counts: Sequence[int] | None = None,
    *,
    nonfinite: NonFinite = "propagate",
) -> list[float]:
    """Mean of each parameter over all M microbatches, absent counting as zero.

    Args:
        rows: M microbatches, each a list of P values (int or float) or
            ``None`` where the parameter was absent.
        active_counts: participation counters, accepted for compatibility and
            checked to be non-negative integers. They are never a divisor.
        nonfinite: ``"propagate"`` (default) or ``"raise"`` on NaN or Inf.

    Returns:
        P floats, ``sum_i (rows[i][j] or 0) / M``; ``[]`` when there are no
        microbatches.

    Raises:
        GradaggError: a ragged microbatch, a non-numeric value, a bad counter.

    >>> microbatch_mean([[2, None], [4, 6]], [1, 2])
    [3.0, 3.0]
    """
    check_nonfinite(nonfinite)
    _check_rows(rows, "microbatches")
    if active_counts is not None:
        _check_active_counts(active_counts)
    if len(rows) == 0:
        return []
    width = _check_microbatches(rows, nonfinite)
    m = len(rows)  # the divisor: counted microbatches, nothing else
    sums: list[Number] = [0] * width
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if value is not None:  # absent contributes zero
                sums[j] = _plus(sums[j], value, f"microbatch {i}, parameter {j}: adding", "sum")  # type: ignore[arg-type]
    return [_divide(s, m, j) for j, s in enumerate(sums)]


# --- owner-sum helpers -------------------------------------------------------


def _check_row(r: int, row: object) -> tuple[ShardId, object, object, Gradient]:
    if isinstance(row, (str, bytes, dict)) or not isinstance(row, Sequence):
        raise RowShapeError(
            f"row {r}: expected a list [shard_id, worker_id, owner_id, gradient], got {short_repr(row)}"
        )
    if len(row) != 4:
        raise RowShapeError(
            f"row {r}: expected 4 fields [shard_id, worker_id, owner_id, gradient], "
            f"got {len(row)}: {short_repr(list(row))}"
        )
    for name, value in zip(_ID_FIELDS, row[:3]):
        _check_id(r, name, value)
    return row[0], row[1], row[2], _check_gradient(r, row[3])  # type: ignore[return-value]


def _check_id(r: int, name: str, value: object) -> None:
    if value is None:
        raise IdError(f"row {r}: {name} is missing (None); every row needs a shard, worker and owner id")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise IdError(f"row {r}: {name} must be an int or a string, got {type(value).__name__} {short_repr(value)}")


def _is_number(value: object) -> bool:
    # bool is an int subclass, but True as a gradient is almost always a bug.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_gradient(r: int, gradient: object) -> Gradient:
    if _is_number(gradient):
        return gradient  # type: ignore[return-value]
    if isinstance(gradient, (list, tuple)):
        for k, x in enumerate(gradient):
            if not _is_number(x):
                raise GradientTypeError(
                    f"row {r}: gradient element {k} must be a number, got {type(x).__name__} {short_repr(x)}"
                )
        return list(gradient)
    raise GradientTypeError(
        f"row {r}: gradient must be a number or a list of numbers, got {type(gradient).__name__} {short_repr(gradient)}"
    )


def _check_shape(
    r: int, shard: ShardId, gradient: Gradient, shapes: dict[ShardId, tuple[int | None, int]]
) -> None:
    length = len(gradient) if isinstance(gradient, list) else None
    if shard not in shapes:
        shapes[shard] = (length, r)
        return
    expected, first = shapes[shard]
    if length != expected:
        raise GradientShapeError(
            f"row {r}: gradient of shard {short_repr(shard)} is {_describe(length)}, "
            f"expected {_describe(expected)} (from row {first})"
        )


def _describe(length: int | None) -> str:
    return "a scalar" if length is None else f"a vector of length {length}"


def _add(r: int, shard: ShardId, total: Gradient, gradient: Gradient) -> Gradient:
    where = f"row {r}: adding gradient"
    if isinstance(total, list):
        of = f"total of shard {short_repr(shard)}"
        return [_plus(a, b, f"{where} element {k}", of) for k, (a, b) in enumerate(zip(total, gradient))]  # type: ignore[arg-type]
    return _plus(total, gradient, where, f"total of shard {short_repr(shard)}")  # type: ignore[arg-type]


def _sorted_shards(totals: dict[ShardId, Gradient], shapes: dict[ShardId, tuple[int | None, int]]) -> list[ShardId]:
    try:
        return sorted(totals)
    except TypeError:
        pass
    # Find a concrete pair to name; ints and strings are the only id types.
    ints = [s for s in totals if isinstance(s, int)]
    strs = [s for s in totals if isinstance(s, str)]
    a, b = ints[0], strs[0]
    raise UnorderableShardError(
        f"shard ids {short_repr(a)} (row {shapes[a][1]}, int) and {short_repr(b)} (row {shapes[b][1]}, str) "
        "cannot be ordered against each other; use one id type for all shards"
    ) from None


# --- microbatch helpers ------------------------------------------------------


def _check_microbatches(rows: Sequence[Sequence[object]], nonfinite: NonFinite) -> int:
    width: int | None = None
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes, dict)) or not isinstance(row, Sequence):
            raise RowShapeError(f"microbatch {i}: expected a list of values, got {short_repr(row)}")
        if width is None:
            width = len(row)
        elif len(row) != width:
            raise RowShapeError(f"microbatch {i}: has {len(row)} values, expected {width} (from microbatch 0)")
        for j, value in enumerate(row):
            _check_value(i, j, value, nonfinite)
    return width or 0


def _check_value(i: int, j: int, value: object, nonfinite: NonFinite) -> None:
    if value is None:
        return
    if not _is_number(value):
        raise GradientTypeError(
            f"microbatch {i}, parameter {j}: value must be a number or None (absent), "
            f"got {type(value).__name__} {short_repr(value)}"
        )
    if nonfinite == "raise":
        _check_finite(value, f"microbatch {i}, parameter {j}")  # type: ignore[arg-type]


def _check_active_counts(active_counts: Sequence[int]) -> None:
    if isinstance(active_counts, (str, bytes)) or not isinstance(active_counts, Sequence):
        raise GradientTypeError(f"active_counts must be a list of integers, got {short_repr(active_counts)}")
    for k, c in enumerate(active_counts):
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise GradientTypeError(f"active_counts[{k}] must be a non-negative integer, got {short_repr(c)}")


# --- shared ------------------------------------------------------------------


def _check_rows(rows: object, what: str) -> None:
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Sequence):
        raise RowShapeError(f"rows must be a list of {what}, got {short_repr(rows)}")


def _plus(total: Number, value: Number, where: str, of: str) -> Number:
    """``total + value``; an int too large for a float meeting a float is an error, not an OverflowError."""
    try:
        return total + value
    except OverflowError:
        raise NumberRangeError(
            f"{where} {_magnitude(value)} to the {of} ({_magnitude(total)}) overflows a float: an integer "
            "beyond 1.8e308 cannot be added to a float"
        ) from None


def _divide(total: Number, m: int, j: int) -> float:
    try:
        return total / m
    except OverflowError:
        raise NumberRangeError(
            f"parameter {j}: the sum {_magnitude(total)} over M = {m} microbatches is too large for a float"
        ) from None


def _magnitude(x: Number) -> str:
    """A number for a message: a huge int by its size (its digits would fill the screen)."""
    if isinstance(x, int) and x.bit_length() > 64:
        return f"<an int of about {int(x.bit_length() * 0.30103) + 1} digits>"
    return repr(x)


def _check_finite(gradient: Gradient, where: str) -> None:
    values = gradient if isinstance(gradient, list) else [gradient]
    for k, x in enumerate(values):
        if isinstance(x, float) and not math.isfinite(x):
            at = f" element {k}" if isinstance(gradient, list) else ""
            raise NonFiniteGradientError(f"{where}{at} is {short_repr(x)}; NaN and Inf are values, not absence")
