"""The engine's two accumulators: both contracts fed batch by batch (part of :mod:`gradagg.rows.engine`).

Each chooses its backend and conversions (a :class:`~gradagg.rows.engine._route.Route`)
from the first batch it is fed, and keeps them: later batches of another kind
are converted, or refused by the backend, never silently re-routed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gradagg.errors import GradaggError
from gradagg.options import check_engine, check_nonfinite
from gradagg.rows.backends import MeanTable, OwnerSumTable
from gradagg.rows.engine._route import Route, kind


class _BatchFed:
    """What both accumulators share: the options, and the route (backend, conversions) set on the first batch."""

    def __init__(self, *, engine: str = "auto", nonfinite: str = "propagate") -> None:
        self._engine = check_engine(engine)
        self._nonfinite = check_nonfinite(nonfinite)
        self._route: Route | None = None

    @property
    def engine(self) -> str | None:
        """The engine in use: resolved on the first batch, ``None`` before it."""
        return None if self._route is None else self._route.name


class ColumnarOwnerSum(_BatchFed):

    """Owner-only shard reduction fed in batches of rows.

    Each shard's total adds its owner gradients one at a time in the order
    rows were fed, across ``update`` calls: the result is that of one
    :func:`gradagg.rows.engine.owner_sum_columns` call on the concatenated batches (bit for bit on
    CPU). Memory grows with the distinct shards, except on ``"python"``, which
    keeps every row (it is the oracle).

    Args:
        engine: as for :func:`gradagg.rows.engine.owner_sum_columns`; ``"auto"`` is resolved on the first batch.
        nonfinite: ``"propagate"`` or ``"raise"``; rows are numbered from the first batch's first row.

    >>> import numpy as np
    >>> acc = ColumnarOwnerSum()
    >>> acc.update(np.array([1, 1]), np.array([0, 1]), np.array([0, 0]), np.array([2, 9]))
    >>> acc.update(np.array([1, 2]), np.array([0, 5]), np.array([0, 5]), np.array([3, 4]))
    >>> [a.tolist() for a in acc.result()]
    [[1, 2], [5, 4]]
    """

    _impl: OwnerSumTable

    def update(self, shard_ids: Any, worker_ids: Any = None, owner_ids: Any = None, gradients: Any = None) -> None:
        """Feed a batch of rows: four columns, or one Arrow table/record batch.

        Args:
            shard_ids: as for :func:`gradagg.rows.engine.owner_sum_columns` (or an Arrow table).
            worker_ids: as for :func:`gradagg.rows.engine.owner_sum_columns`.
            owner_ids: as for :func:`gradagg.rows.engine.owner_sum_columns`.
            gradients: as for :func:`gradagg.rows.engine.owner_sum_columns`.

        Raises:
            GradaggError: as for :func:`gradagg.rows.engine.owner_sum_columns`; also a batch whose id
                type or gradient shape differs from earlier batches.
        """
        for shards, workers, owners, grads in _owner_columns(shard_ids, worker_ids, owner_ids, gradients):
            if self._route is None:
                self._route = Route(self._engine, shards, grads)
                self._impl = self._route.backend.ColumnarOwnerSum(nonfinite=self._nonfinite)
            r = self._route
            self._impl.update(r.ids_in(shards), r.ids_in(workers), r.ids_in(owners), r.numbers_in(grads))

    def result(self) -> tuple[Any, Any]:
        """Return ``(shards, totals)`` over every row fed so far (shards sorted).

        Returns:
            As for :func:`gradagg.rows.engine.owner_sum_columns`; empty arrays before any batch.
        """
        if self._route is None:
            self.update([], [], [], [])
        assert self._route is not None  # set by update; for mypy
        shards, totals = self._impl.result()
        return self._route.ids_out(shards), self._route.values_out(totals)


class ColumnarMean(_BatchFed):

    """The microbatch mean fed a few microbatches at a time.

    Keeps one float64 sum per parameter and the count M of microbatches fed;
    ``result()`` divides by that M, never by participation. For input split by
    parameters instead, see :func:`gradagg.rows.engine.microbatch_mean_batches`.

    Args:
        engine: as for :func:`gradagg.rows.engine.microbatch_mean_columns`.
        nonfinite: ``"propagate"`` or ``"raise"``; microbatches are numbered across updates.

    >>> import numpy as np
    >>> acc = ColumnarMean()
    >>> acc.update(np.array([[2.0, 5.0]]), np.array([[True, False]]))
    >>> acc.update(np.array([[4.0, 6.0]]))
    >>> acc.result().tolist()
    [3.0, 3.0]
    """

    _impl: MeanTable

    def update(self, values: Any, present: Any = None) -> None:
        """Feed k microbatches: ``values`` of shape ``(k, P)`` and their ``present`` mask.

        Args:
            values: a ``(k, P)`` array or tensor, or an Arrow table whose k
                columns are microbatches (nulls absent).
            present: ``(k, P)`` booleans, True where present; ``None`` = all.

        Raises:
            GradaggError: as for :func:`gradagg.rows.engine.microbatch_mean_columns`; also a batch
                whose P differs from earlier batches.
        """
        if kind(values) == "arrow":
            from gradagg.rows.formats import arrow  # (pyarrow: imported only for Arrow input)

            values, present = arrow.microbatch_columns(values)
        if self._route is None:
            self._route = Route(self._engine, None, values)
            self._impl = self._route.backend.ColumnarMean(nonfinite=self._nonfinite)
        self._impl.update(self._route.numbers_in(values), self._route.numbers_in(present))

    def result(self) -> Any:
        """Return the ``(P,)`` float64 means over the microbatches fed (empty before any).

        Returns:
            As for :func:`gradagg.rows.engine.microbatch_mean_columns`.
        """
        if self._route is None:
            self._route = Route(self._engine, None, [])
            self._impl = self._route.backend.ColumnarMean(nonfinite=self._nonfinite)
        return self._route.values_out(self._impl.result())

    def _mean_of_lists(self, rows: Any) -> list[Any]:
        """The list-of-lists form of :func:`gradagg.rows.microbatch_mean_columns` (one call, not fed in batches)."""
        self._route = route = Route(self._engine, None, _first_item(rows))
        items = [[None if v is None else route.numbers_in(v) for v in row] for row in rows]
        means = route.backend.microbatch_mean(items, None, nonfinite=self._nonfinite)
        return [route.values_out(m) for m in means]


def _first_item(values: Any) -> Any:
    """The first non-None leaf of a list-of-lists input (its kind decides ``auto``)."""
    for row in values:
        for item in row if isinstance(row, (list, tuple)) else [row]:
            if item is not None:
                return item
    return values


def _owner_columns(shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> Iterator[tuple[Any, ...]]:
    """Yield ``(shards, workers, owners, gradients)`` batches: one, or one per Arrow record batch."""
    if kind(shard_ids) == "arrow":
        if not (worker_ids is None and owner_ids is None and gradients is None):
            raise GradaggError("pass an Arrow table alone: owner_sum_columns(table), not with other columns")
        from gradagg.rows.formats import arrow

        yield from arrow.owner_columns(shard_ids)
        return
    named = (("worker_ids", worker_ids), ("owner_ids", owner_ids), ("gradients", gradients))
    missing = [name for name, column in named if column is None]
    if missing:
        raise GradaggError(f"missing column(s) {', '.join(missing)}: pass four columns, or one Arrow table alone")
    yield shard_ids, worker_ids, owner_ids, gradients
