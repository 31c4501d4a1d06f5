"""The ``"python"`` engine: the pure-Python reference run on columns turned into rows.

It is the oracle itself, so it is slow and keeps every row it is fed; it
exists to cross-check the fast engines from the same entry points. Results are
NumPy arrays when NumPy is installed (the columnar promise), lists otherwise.
"""

from __future__ import annotations

from typing import Any

from gradagg import reference
from gradagg.errors import RowShapeError


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
    acc = OwnerSumAccumulator(nonfinite=nonfinite)
    acc.update(shard_ids, worker_ids, owner_ids, gradients)
    return acc.result()


def microbatch_mean(values: Any, present: Any = None, *, nonfinite: str = "propagate") -> Any:
    """:func:`gradagg.reference.microbatch_mean` on an ``(M, P)`` input and its ``present`` mask.

    Args:
        values: M rows of P numbers (``None`` = absent allowed in lists).
        present: M rows of P booleans, or ``None``.
        nonfinite: ``"propagate"`` or ``"raise"``.

    Returns:
        P float64 means.

    Raises:
        GradaggError: whatever the reference raises.

    >>> microbatch_mean([[2, None], [4, 6]]).tolist()
    [3.0, 3.0]
    """
    acc = MicrobatchMeanAccumulator(nonfinite=nonfinite)
    acc.update(values, present)
    return acc.result()


class OwnerSumAccumulator:
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
        self._ids = shard_ids if self._ids is None else self._ids
        self._gradients = gradients if self._gradients is None else self._gradients

    def result(self) -> tuple[Any, Any]:
        """Run the reference over every row fed; return ``(shards, totals)``."""
        pairs = reference.owner_sum(self._rows, nonfinite=self._nonfinite)  # type: ignore[arg-type]
        shards = [p[0] for p in pairs]
        totals = [p[1] for p in pairs]
        np = _numpy()
        if np is None:
            return shards, totals
        return _shards_like(np, shards, self._ids), _totals_like(np, totals, self._gradients)


class MicrobatchMeanAccumulator:
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
            mask = _tolist(present)
            rows = [[v if p else None for v, p in zip(row, prow)] for row, prow in zip(rows, mask)]
        self._rows.extend(rows)

    def result(self) -> Any:
        """Run the reference: P float means over the M microbatches fed."""
        means = reference.microbatch_mean(self._rows, nonfinite=self._nonfinite)  # type: ignore[arg-type]
        np = _numpy()
        return means if np is None else np.asarray(means, dtype=np.float64)


def _tolist(x: Any) -> list[Any]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _as_numpy(np: Any, sample: Any) -> Any:
    if hasattr(sample, "detach"):  # a torch tensor: its NumPy twin has the same dtype and shape
        return sample.detach().cpu().numpy()
    return np.asarray(sample) if sample is not None else np.empty(0)


def _shards_like(np: Any, items: list[Any], sample: Any) -> Any:
    """Shard ids as int64 or ``<U``; an empty result keeps the input's id type."""
    if items:
        return np.asarray(items)
    a = _as_numpy(np, sample)
    return np.empty(0, dtype="<U1" if a.dtype.kind in "US" else np.int64)


def _totals_like(np: Any, items: list[Any], sample: Any) -> Any:
    """Totals as int64 for integer gradients, else float64; shape ``(S,)`` or ``(S, D)``."""
    a = _as_numpy(np, sample)
    dtype = np.int64 if a.dtype.kind in "iu" else np.float64
    if items:
        return np.asarray(items, dtype=dtype)
    return np.empty((0, *a.shape[1:2]), dtype=dtype)
