"""Python rows to NumPy columns, once, for the fast engines (called by :mod:`gradagg.rows.engine` only).

The reference sums Python numbers: integers exactly, floats in row order, and
a total stays an ``int`` until its first float (``int + float`` rounds the
integer to a float first). A float64 column cannot say which of its values were
integers, so rows whose gradients mix ints and floats are split here into an
int64 column (floats as 0) and a float64 column (ints rounded, as Python
rounds them), each run through the engine, and put back together per shard and
element:

* a shard (element) whose counted gradients are all ints takes its exact int64
  total;
* any other takes its float64 total, which is bit-identical to the reference's
  as long as the integers it met sum to at most 2**53 in magnitude: every
  partial sum of those integers is then exact in float64, so the float total
  goes through the same values as Python's. Beyond that the engine would round
  where Python does not, and says so instead.

Nothing here chooses a backend: ``run`` (from the engine) does the sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gradagg.errors import GradaggError, short_repr

Array = NDArray[Any]
OwnerRun = Callable[[Any, Any, Any, Any], tuple[list[Any], list[Any]]]
MeanRun = Callable[[Any, Any], list[Any]]
_EXACT = 2**53  # integers up to this magnitude, and their sums up to it, are exact in float64
_INT64 = (-(2**63), 2**63 - 1)
_ANY_ENGINE = "use engine='python' (the reference), which sums Python integers exactly"


def owner_sum(rows: Sequence[Sequence[object]], run: OwnerRun) -> list[list[object]]:
    """The reference's ``[[shard, total], ...]`` for ``rows``, with the sums done by ``run`` on columns.

    >>> run = lambda s, w, o, g: (sorted(set(s)), [int(g.sum())])
    >>> owner_sum([["x", "a", "a", 1], ["x", "a", "a", 2]], run)
    [['x', 3]]
    """
    shards, workers, owners, gradients = _owner_columns(rows)
    numbers = _numbers(gradients, "gradient", vectors=True)
    if numbers.is_float.all() or not numbers.is_float.any():
        found, totals = run(shards, workers, owners, numbers.floats if numbers.is_float.any() else numbers.ints())
        return [[s, t] for s, t in zip(found, totals)]
    found, ints = run(shards, workers, owners, numbers.ints())
    _, floats = run(shards, workers, owners, numbers.floats)
    _, float_counts = run(shards, workers, owners, numbers.is_float.astype(np.int64))
    _, magnitudes = run(shards, workers, owners, numbers.magnitudes())
    pairs = []
    for shard, i, f, c, m in zip(found, ints, floats, float_counts, magnitudes):
        pairs.append([shard, _combine(i, f, c, m, f"shard {short_repr(shard)}")])
    return pairs


def microbatch_mean(rows: Sequence[Sequence[object]], run: MeanRun) -> list[float]:
    """The reference's means for ``rows`` (``None`` = absent), with the sums done by ``run(values, present)``.

    >>> microbatch_mean([[2, None], [4, 6]], lambda v, p: (v * p).sum(axis=0) / len(v))
    [3.0, 3.0]
    """
    width = _check_microbatches(rows)
    if not rows:
        return []
    flat = [v for row in rows for v in row]
    present = np.fromiter((v is not None for v in flat), dtype=bool, count=len(flat))
    numbers = _numbers([0 if v is None else v for v in flat], "value", vectors=False)
    shape = (len(rows), width)
    if not numbers.is_float[present].any():  # only ints (or nothing): the backends sum int64 exactly
        return [float(x) for x in run(numbers.ints().reshape(shape), present.reshape(shape))]
    magnitudes = numbers.magnitudes().reshape(shape).sum(axis=0)
    if (magnitudes > _EXACT).any():
        j = int(np.flatnonzero(magnitudes > _EXACT)[0])
        raise GradaggError(
            f"parameter {j}: its values mix floats with integers summing to more than 2**53 in magnitude, "
            f"which a float64 sum would round; {_ANY_ENGINE}"
        )
    return [float(x) for x in run(numbers.floats.reshape(shape), present.reshape(shape))]


class _Numbers:
    """A column of Python numbers as float64 values plus which of them were floats (the rest ints)."""

    def __init__(self, values: list[Any], shape: tuple[int, ...], is_float: Array, where: str) -> None:
        self.values, self.shape, self.is_float, self.where = values, shape, is_float, where
        self._ints: Array | None = None
        try:
            self.floats = np.array(values, dtype=np.float64).reshape(shape)  # Python's own int -> float rounding
        except OverflowError:
            raise GradaggError(f"{where}: an integer is too large for a float64 (above ~1.8e308)") from None

    def ints(self) -> Array:
        """The integers, exactly, with 0 in place of each float; beyond int64 is an error naming the row."""
        if self._ints is None:
            self._ints = self._exact_ints()
        return self._ints

    def _exact_ints(self) -> Array:
        picked = [0 if f else v for v, f in zip(self.values, self.is_float.reshape(-1).tolist())]
        try:
            return np.array(picked, dtype=np.int64).reshape(self.shape)
        except OverflowError:
            k = next(k for k, v in enumerate(picked) if not _INT64[0] <= v <= _INT64[1])
            raise GradaggError(
                f"row {k // _per_row(self.shape)}: {self.where} {picked[k]} is beyond int64; {_ANY_ENGINE}"
            ) from None

    def magnitudes(self) -> Array:
        """|integer| per value (0 for floats), capped above 2**53: only whether a sum passes 2**53 matters."""
        capped = [0 if f else min(abs(v), 2**54) for v, f in zip(self.values, self.is_float.reshape(-1).tolist())]
        return np.array(capped, dtype=np.int64).reshape(self.shape)  # exact: Python ints, never via float64


def _per_row(shape: tuple[int, ...]) -> int:
    return int(shape[1]) if len(shape) == 2 else 1


def _combine(i: Any, f: Any, count: Any, magnitude: Any, where: str) -> Any:
    """Per element: the exact int total where no float was counted, else the float total (if exact)."""
    if isinstance(i, list):
        return [_combine(*parts, f"{where} element {k}") for k, parts in enumerate(zip(i, f, count, magnitude))]
    if count == 0:
        return i
    if magnitude > _EXACT:
        raise GradaggError(
            f"{where}: gradients mix floats with integers summing to more than 2**53 in magnitude, which a "
            f"float64 sum would round; {_ANY_ENGINE}"
        )
    return f


def _owner_columns(rows: Sequence[Sequence[object]]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    for r, row in enumerate(rows):
        if isinstance(row, (str, bytes, dict)) or not isinstance(row, Sequence) or len(row) != 4:
            raise GradaggError(f"row {r}: expected a list [shard_id, worker_id, owner_id, gradient]")
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]


def _check_microbatches(rows: Sequence[Sequence[object]]) -> int:
    width = len(rows[0]) if rows and isinstance(rows[0], Sequence) else 0
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes, dict)) or not isinstance(row, Sequence) or len(row) != width:
            raise GradaggError(f"microbatch {i}: expected a list of {width} values")
    return width


def _numbers(column: list[Any], what: str, *, vectors: bool) -> _Numbers:
    """Check that every entry is a number (or, with ``vectors``, every row a list of one length D)."""
    lists = [isinstance(g, (list, tuple)) for g in column] if vectors else []
    if any(lists) and not all(lists):
        raise GradaggError(
            f"row {lists.index(False)}: {what} is a scalar but row {lists.index(True)}'s is a vector: the columnar "
            f"engines hold one shape for all rows; {_ANY_ENGINE}"
        )
    if lists and all(lists):
        lengths = {len(g) for g in column}
        if len(lengths) > 1:
            raise GradaggError(
                f"{what}s are vectors of lengths {sorted(lengths)}: the columnar engines hold one length D "
                f"for all rows; {_ANY_ENGINE}"
            )
        flat = [x for g in column for x in g]
        shape: tuple[int, ...] = (len(column), lengths.pop())
    else:
        flat, shape = list(column), (len(column),)
    kinds = [_kind(x) for x in flat]
    if "other" in kinds:
        k = kinds.index("other")
        raise GradaggError(f"row {k // _per_row(shape)}: {what} {short_repr(flat[k])} is not a number")
    return _Numbers(flat, shape, np.array([k == "float" for k in kinds], dtype=bool).reshape(shape), what)


def _kind(x: object) -> str:
    if isinstance(x, bool):
        return "other"
    if isinstance(x, int):
        return "int"
    return "float" if isinstance(x, float) else "other"
