"""The ``"python"`` engine: the pure-Python reference run on columns turned into rows.

It is the oracle itself, so it is slow and keeps every row it is fed; it
exists to cross-check the fast engines from the same entry points. Results are
NumPy arrays when NumPy is installed (the columnar promise), lists otherwise;
string shards are an object array of the strings themselves (``<U`` would drop
trailing NULs), and integer totals beyond int64 an object array of Python ints.
"""

from __future__ import annotations

import re
from typing import Any

from gradagg import reference
from gradagg.errors import GradaggError, RowShapeError


def owner_sum(
    shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any, *, nonfinite: str = "propagate"
) -> tuple[Any, Any]:
    """:func:`gradagg.reference.owner_sum` on four columns.

    Args:
        shard_ids: N ids (array, tensor or list).
        worker_ids: N ids.
        owner_ids: N ids.
        gradients: N numbers or N lists of numbers.
        nonfinite: ``"propagate"`` or ``"raise"``.

    Returns:
        ``(shards, totals)`` as arrays (lists without NumPy).

    Raises:
        GradaggError: whatever the reference raises, or columns of unequal length.

    >>> s, t = owner_sum(["x", "x"], ["a", "b"], ["a", "a"], [1, 9])
    >>> s.tolist(), t.tolist()
    (['x'], [1])
    """
    acc = ColumnarOwnerSum(nonfinite=nonfinite)
    acc.update(shard_ids, worker_ids, owner_ids, gradients)
    return acc.result()


def microbatch_mean(
    values: Any, present: Any = None, *, nonfinite: str = "propagate", parameter_offset: int = 0
) -> Any:
    """:func:`gradagg.reference.microbatch_mean` on an ``(M, P)`` input and its ``present`` mask.

    Args:
        values: M rows of P numbers (``None`` = absent allowed in lists).
        present: M rows of P booleans, or ``None``.
        nonfinite: ``"propagate"`` or ``"raise"``.
        parameter_offset: the number of the first parameter, in messages (a batch of a longer input).

    Returns:
        P float64 means.

    Raises:
        GradaggError: whatever the reference raises.

    >>> microbatch_mean([[2, None], [4, 6]]).tolist()
    [3.0, 3.0]
    """
    acc = ColumnarMean(nonfinite=nonfinite)
    acc.update(values, present)
    try:
        return acc.result()
    except GradaggError as exc:
        if not parameter_offset:
            raise
        # The reference numbers the parameters of these rows from 0: renumber them as the longer input's.
        renumbered = re.sub(r"parameter (\d+)", lambda m: f"parameter {int(m.group(1)) + parameter_offset}", str(exc))
        raise type(exc)(renumbered) from None


class ColumnarOwnerSum:
    """Collects rows and runs the reference on all of them in :meth:`result` (memory grows with rows)."""

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        self._nonfinite = nonfinite
        self._rows: list[list[Any]] = []
        self._ids: Any = None
        self._gradients: Any = None

    def update(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> None:
        """Append a batch of rows (columns of equal length)."""
        columns = [_tolist(c) for c in (shard_ids, worker_ids, owner_ids, gradients)]
        lengths = [len(c) for c in columns]
        if len(set(lengths)) > 1:
            names = ("shard_ids", "worker_ids", "owner_ids", "gradients")
            listed = ", ".join(f"{n} has {k}" for n, k in zip(names, lengths))
            raise RowShapeError(f"columns differ in length: {listed} rows")
        self._rows.extend(list(row) for row in zip(*columns))
        if self._ids is None or not len(self._ids):  # the first batch with rows shows the id and value types
            self._ids, self._gradients = shard_ids, gradients

    def result(self) -> tuple[Any, Any]:
        """Run the reference over every row fed; return ``(shards, totals)``."""
        pairs = reference.owner_sum(self._rows, nonfinite=self._nonfinite)  # type: ignore[arg-type]
        shards = [p[0] for p in pairs]
        totals = [p[1] for p in pairs]
        np = _numpy()
        if np is None:
            return shards, totals
        return _shards_like(np, shards, self._ids), _totals_like(np, totals, self._gradients)


class ColumnarMean:
    """Collects microbatches and runs the reference in :meth:`result`."""

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        self._nonfinite = nonfinite
        self._rows: list[list[Any]] = []

    def update(self, values: Any, present: Any = None) -> None:
        """Append microbatches, writing ``None`` where ``present`` is False."""
        rows = _tolist(values)
        width = len(self._rows[0]) if self._rows else None
        for i, row in enumerate(rows):
            if width is not None and len(row) != width:
                raise RowShapeError(
                    f"microbatch {len(self._rows) + i}: has {len(row)} values, expected {width} (from microbatch 0)"
                )
        if present is not None:
            if _shape(present) != _shape(values):  # zip would silently cut the longer one short
                raise RowShapeError(
                    f"present has shape {_shape(present)}, values have shape {_shape(values)}; they must match"
                )
            mask = _tolist(present)
            rows = [[v if p else None for v, p in zip(row, prow)] for row, prow in zip(rows, mask)]
        self._rows.extend(rows)

    def result(self) -> Any:
        """Run the reference: P float means over the M microbatches fed."""
        means = reference.microbatch_mean(self._rows, nonfinite=self._nonfinite)  # type: ignore[arg-type]
        np = _numpy()
        return means if np is None else np.asarray(means, dtype=np.float64)


def _shape(x: Any) -> tuple[int, ...]:
    """The shape of an array, a tensor, or a list of equal-length rows (rows of other lengths: just ``(M,)``)."""
    if hasattr(x, "shape"):
        return tuple(int(d) for d in x.shape)
    rows = list(x)
    lengths = {len(r) if isinstance(r, (list, tuple)) else -1 for r in rows}
    return (len(rows), lengths.pop()) if len(lengths) == 1 and -1 not in lengths else (len(rows),)


def _tolist(x: Any) -> list[Any]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _as_numpy(np: Any, sample: Any) -> Any:
    if hasattr(sample, "detach"):  # a torch tensor: only its dtype and shape are read
        return np.empty(tuple(sample.shape), dtype=np.float64 if sample.is_floating_point() else np.int64)
    if sample is None:
        return np.empty(0)
    try:  # only the dtype kind and the shape are read: a <U array's dropped NULs do not matter here
        return np.asarray(sample)
    except (ValueError, OverflowError):
        return np.empty(0, dtype=object)


def _shards_like(np: Any, items: list[Any], sample: Any) -> Any:
    """Shard ids as int64, or an object array of str (or of ints beyond int64); an empty result keeps the id type."""
    fixed = isinstance(sample, np.ndarray) and sample.dtype.kind == "U"  # <U in, <U out: no trailing NUL to lose
    if items:  # any other strings as objects (a list's "a\0" would lose its NUL in <U)
        kind: Any = np.int64 if isinstance(items[0], int) else str if fixed else object
        return _exact_array(np, items, kind)
    a = _as_numpy(np, sample)
    return np.empty(0, dtype="<U1" if fixed else object if a.dtype.kind in "USO" else np.int64)


def _totals_like(np: Any, items: list[Any], sample: Any) -> Any:
    """Totals as int64 where the reference's are all ints (objects beyond int64), else float64; ``(S,)`` or ``(S, D)``.

    The reference's own totals decide: the gradients' array would not say (NumPy makes ``[2**63, 1]`` float64).
    """
    if items:
        flat = [x for t in items for x in (t if isinstance(t, list) else [t])]
        return _exact_array(np, items, np.int64 if all(isinstance(x, int) for x in flat) else np.float64)
    from gradagg.rows.backends import _checks  # (NumPy's: imported only where NumPy is)

    a = _as_numpy(np, sample)
    return np.empty((0, *a.shape[1:2]), dtype=_checks.sum_dtype(a))


def _exact_array(np: Any, items: list[Any], dtype: Any) -> Any:
    """``items`` as one array of ``dtype``, or as objects where that dtype would not hold them exactly."""
    try:
        return np.array(items, dtype=dtype) if dtype is not object else _objects(np, items)  # (str: a <U array)
    except OverflowError:  # the reference's unbounded ints: kept exact, as Python ints
        return _objects(np, items)


def _objects(np: Any, items: list[Any]) -> Any:
    a = np.empty(len(items), dtype=object)
    a[:] = items
    return a
