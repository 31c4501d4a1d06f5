"""Fast paths for the two contracts, one module per array framework, all behind :class:`Backend`.

:mod:`gradagg.rows.backends.python` (the reference itself: slow, obviously right),
:mod:`gradagg.rows.backends.numpy` and :mod:`gradagg.rows.backends.torch_tensors` expose the same
names, which :class:`Backend` states for the type checker:

``owner_sum(shard_ids, worker_ids, owner_ids, gradients, *, nonfinite)``
    Owner-only shard reduction over columns; returns ``(shards, totals)``.
``microbatch_mean(values, present, *, nonfinite, parameter_offset)``
    Mean over M microbatches with explicit absence; the divisor is M.
``ColumnarOwnerSum`` / ``ColumnarMean``
    The same contracts fed in batches (``update(...)`` then ``result()``).

Nothing here imports a framework: importing :mod:`gradagg.rows.backends` is free,
and each backend module imports its framework itself. :mod:`gradagg.rows.engine` is
the one place that chooses a backend for an input and converts between
frameworks; no backend calls another.

Private helpers, NumPy only, shared by the numpy and torch backends: ``_checks``
(input checks and the one NaN locator), ``_strings`` (ids held as Python keys,
with integer codes), ``_factor`` (sorted factorisation of integer and ``<U``
ids), ``_tables`` and ``_mean`` (the NumPy backend's owner-sum tables and mean),
``_rows`` (the engine's one conversion of the reference's Python rows into columns).
"""

from __future__ import annotations

from typing import Any, Protocol


class OwnerSumTable(Protocol):
    """A backend's owner-sum accumulator: rows fed in batches, ``(shards, totals)`` at the end."""

    def update(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> None: ...

    def result(self) -> tuple[Any, Any]: ...


class MeanTable(Protocol):
    """A backend's microbatch-mean accumulator: microbatches fed in batches, the P means at the end."""

    def update(self, values: Any, present: Any = None) -> None: ...

    def result(self) -> Any: ...


class Backend(Protocol):
    """What :mod:`gradagg.rows.engine` calls on a backend module (each of python, numpy, torch is one).

    The columns are ``Any`` on purpose: each backend takes its own framework's
    arrays (and lists); the engine converts them before the call.
    """

    def ColumnarOwnerSum(self, *, nonfinite: str = ...) -> OwnerSumTable: ...  # noqa: N802 (a class)

    def ColumnarMean(self, *, nonfinite: str = ...) -> MeanTable: ...  # noqa: N802 (a class)

    def microbatch_mean(
        self, values: Any, present: Any = ..., *, nonfinite: str = ..., parameter_offset: int = ...
    ) -> Any: ...
