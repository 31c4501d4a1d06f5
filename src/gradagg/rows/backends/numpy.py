"""NumPy backend: both contracts on NumPy arrays.

Owner-sum keeps a table of per-shard totals, in one of two layouts:

* dense: integer shard ids whose range is small (at most ``_tables.DENSE_LIMIT``
  table cells) index the table directly, ``totals[shard - lo]``; the table
  grows (at least doubling) when a batch's ids fall outside it. With the
  kernels (the ``numba`` engine) one fused pass does compare, mask and add,
  and batches of at least two chunks of scalar gradients use a second core:
  it copies the owner rows of the batch's back half out of the way while the
  first core adds the front half, then the first core adds those copies,
  still chunk after chunk in row order;
* sorted: any other integer ids (sparse, or vectors too wide for a dense
  table) are factorised (:mod:`gradagg.rows.backends._factor`): the owner rows'
  ids are sorted and made unique, merged into the table's sorted keys, and
  each row's gradient is added at its key's position.

String shard ids in a ``<U`` array (which cannot hold a trailing NUL) take the
sorted layout as packed keys and come back as ``<U``; any other string ids
(object arrays, lists, Arrow dictionaries), ints beyond int64 and columns
mixing ints and strings are given integer codes (:mod:`gradagg.rows.backends._strings`:
exact, NULs and all) that take the integer paths, and come back as an object
array sorted by the ids once, at the end. Worker and owner ids are only compared.

Either way a shard's owner gradients are added one at a time in row order,
into a total that starts at ``-0.0`` (the one value with ``-0.0 + x == x`` for
every x, so the first row's value is kept exactly, sign of zero included):
float totals are bit-identical to :func:`gradagg.reference.owner_sum`.

The tables live in :mod:`gradagg.rows.backends._tables`, the microbatch mean in
:mod:`gradagg.rows.backends._mean`; the adds are ``np.add.at``, which is unbuffered
and goes in row order, or, given ``kernels`` (:mod:`gradagg.rows.backends._kernels`,
handed over by :mod:`gradagg.rows.backends.numba`), fused numba loops that add in
the same order. The engine picks which by its ``engine`` argument only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from gradagg.errors import GradientShapeError, GradientTypeError, UnorderableShardError, short_repr
from gradagg.options import check_nonfinite
from gradagg.rows.backends import _checks, _strings, _tables
from gradagg.rows.backends._mean import ColumnarMean, microbatch_mean
from gradagg.rows.backends._tables import DenseTable, SortedTable, TwoEnds

Array = NDArray[Any]

# NaN and Inf are values (inf + -inf is NaN, 1e308 + 1e308 is inf, as in Python): no NumPy warnings for them.
_IEEE = np.errstate(over="ignore", invalid="ignore")


def owner_sum(
    shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any, *, nonfinite: str = "propagate",
    kernels: Any = None,
) -> tuple[Array, Array]:
    """Owner-only shard reduction on NumPy columns (see :func:`gradagg.rows.engine.owner_sum_columns`).

    Args:
        shard_ids: N int or str ids (integer, ``<U`` or object array, or a list).
        worker_ids: N worker ids.
        owner_ids: N owner ids, of the same type as ``worker_ids``.
        gradients: ``(N,)`` or ``(N, D)`` integers or floats.
        nonfinite: ``"propagate"`` or ``"raise"``.
        kernels: :mod:`gradagg.rows.backends._kernels` for the fused loops (the ``numba`` engine), or None.

    Returns:
        ``(shards, totals)``: sorted shards with an owner row; int64 or float64 totals.

    Raises:
        GradaggError: see :func:`gradagg.rows.engine.owner_sum_columns`.

    >>> s, t = owner_sum(np.array([3, 3, 1]), np.array([0, 1, 2]), np.array([0, 0, 2]), np.array([1.0, 9.0, 2.0]))
    >>> s.tolist(), t.tolist()
    ([1, 3], [2.0, 1.0])
    """
    acc = ColumnarOwnerSum(nonfinite=nonfinite, kernels=kernels)
    acc.update(shard_ids, worker_ids, owner_ids, gradients)
    return acc.result()


class ColumnarOwnerSum:
    """Owner-sum fed in batches; memory grows with distinct shards (or their range), not rows.

    Summation order: every shard's total adds its owner gradients one by one
    in the order rows were fed, across updates (see the module notes).

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.
        kernels: :mod:`gradagg.rows.backends._kernels` for the fused loops (the ``numba`` engine), or None.

    >>> acc = ColumnarOwnerSum()
    >>> acc.update(np.array(["a"]), np.array([0]), np.array([0]), np.array([[1, 2]]))
    >>> acc.update(np.array(["a"]), np.array([1]), np.array([1]), np.array([[3, 4]]))
    >>> [x.tolist() for x in acc.result()]
    [['a'], [[4, 6]]]
    """

    def __init__(self, *, nonfinite: str = "propagate", kernels: Any = None) -> None:
        self._nonfinite = check_nonfinite(nonfinite)
        self._kernels = kernels
        self._rows = 0  # rows fed so far: the offset of the next batch's row numbers
        self._id_kind: str | None = None
        self._names = _strings.Interner()  # codes of string shard ids
        self._shape: tuple[int, ...] | None = None  # () for scalar gradients, (D,) for vectors
        self._dtype: Any = None
        self._table: DenseTable | SortedTable | None = None

    @_IEEE
    def update(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> None:
        """Add a batch of rows (four columns of equal length).

        Args:
            shard_ids: as for :func:`owner_sum`.
            worker_ids: as for :func:`owner_sum`.
            owner_ids: as for :func:`owner_sum`.
            gradients: as for :func:`owner_sum`.

        Raises:
            GradaggError: see :func:`owner_sum`; also a batch whose shard id type
                or gradient shape differs from the earlier batches'.
        """
        shards, workers, owners, grads = self._validate(shard_ids, worker_ids, owner_ids, gradients)
        owned = self._owned_if_needed(shards, workers, owners, grads)
        if len(shards) == 0:
            return
        start = self._add_dense(shards, workers, owners, grads, owned)
        if isinstance(self._table, SortedTable):  # strings, sparse ids, or the rows after a dense table overflowed
            rest = slice(start, None)
            owned_rest = None if owned is None else owned[rest]
            self._table.add(shards[rest], workers[rest], owners[rest], grads[rest], owned_rest)
        self._rows += shards.shape[0]

    def _owned_if_needed(self, shards: Array, workers: Array, owners: Array, grads: Array) -> Array | None:
        """The owner-row mask, computed only for the checks that need it (the tables compute their own)."""
        if self._nonfinite != "raise" and grads.dtype.kind != "i":
            return None
        owned: Array = np.equal(workers, owners)
        if self._nonfinite == "raise":
            self._raise_nonfinite(owned, grads, shards)
        if grads.dtype.kind == "i":
            _checks.check_int_headroom(grads[owned], self._table_absmax())
        return owned

    def _raise_nonfinite(self, owned: Array, grads: Array, shards: Array) -> None:
        found = _checks.first_nonfinite(grads, owned)
        if found is None:
            return
        r = found[0]
        shard = self._names.key(int(shards[r])) if self._keyed() else shards[r].item()
        at = f" element {found[1]}" if len(found) == 2 else ""
        raise _checks.nonfinite_error(f"row {self._rows + r}: gradient of shard {short_repr(shard)}{at}", grads[found])

    def _add_dense(self, shards: Array, workers: Array, owners: Array, grads: Array, owned: Array | None) -> int:
        """Add rows into the dense table, growing it as ids require; return the row where a sorted table takes over."""
        if self._table is None:
            fixed = self._id_kind == "fixed"
            self._table = None if fixed else DenseTable(0, 0, self._shape or (), self._dtype, self._kernels)
        n = len(shards)
        two_cores = self._kernels is not None and grads.ndim == 1 and n >= 2 * _tables.CHUNK
        if two_cores and isinstance(self._table, DenseTable):
            return self._dense_two_cores(shards, workers, owners, grads)
        stop = self._dense_rows(0, n, shards, workers, owners, grads, owned)
        if self._table is None:  # <U ids: straight to the sorted table
            self._table = self._sorted(None)
        return stop

    def _dense_rows(
        self, start: int, stop: int, shards: Array, workers: Array, owners: Array, grads: Array, owned: Array | None
    ) -> int:
        """Rows ``start:stop`` into the dense table, growing it; the row where a sorted table takes over, or stop."""
        cut = slice(0, stop)
        columns = (shards[cut], workers[cut], owners[cut], grads[cut], None if owned is None else owned[cut])
        while isinstance(self._table, DenseTable):
            stopped = self._table.add(start, *columns)
            if stopped is None:
                return stop
            start, lo, hi = stopped
            grown = self._table.grown(lo, hi)
            self._table = grown if grown is not None else self._sorted(self._table)
        return start

    def _dense_two_cores(self, shards: Array, workers: Array, owners: Array, grads: Array) -> int:
        """The fused pass from the front, owner-row compaction from the back, meeting in the middle.

        Rows are still added strictly in row order (chunk after chunk), so the
        totals keep their bits; the second core only saves the first one from
        reading replica rows in the back part of the batch.
        """
        work = TwoEnds(len(shards), self._kernels)
        helper = self._kernels.pool().submit(work.compact_from_back, shards, workers, owners, grads)
        try:
            for lo, hi in work.claim_from_front():
                stop = self._dense_rows(lo, hi, shards, workers, owners, grads, None)
                if stop < hi:  # ids left the dense range: the sorted table takes the rest as plain rows
                    work.cancel()
                    return stop
            for owned_shards, owned_grads in work.compacted():
                self._owned_rows(owned_shards, owned_grads)
        finally:
            helper.result()
        return len(shards)

    def _owned_rows(self, shards: Array, grads: Array) -> None:
        """Add rows already known to be owner rows (compacted), in order."""
        start = 0
        while isinstance(self._table, DenseTable):
            table = self._table
            stop = int(self._kernels.dense_owned(shards, grads, start, table.lo, table.totals, table.seen))
            if stop == len(shards):
                return
            start = stop
            grown = table.grown(int(shards[stop]), int(shards[stop]))
            self._table = grown if grown is not None else self._sorted(table)
        ones = np.ones(len(shards) - start, dtype=bool)
        assert isinstance(self._table, SortedTable)  # the only other layout
        self._table.add(shards[start:], ones, ones, grads[start:], ones)

    def result(self) -> tuple[Array, Array]:
        """Return ``(shards, totals)`` over all rows fed so far, shards sorted ascending.

        Returns:
            Sorted shard ids (int64 or ``<U``) and their int64 or float64 totals.
        """
        if self._table is None:
            kinds: dict[str | None, Any] = {"fixed": "<U1", "str": object, "object": object}
            shards = np.empty(0, dtype=kinds.get(self._id_kind, np.int64))
            return shards, np.empty((0, *(self._shape or ())), dtype=self._dtype or np.float64)
        keys, totals = self._table.result()
        if not self._keyed():
            return keys, totals  # integers, or the sorted <U keys of <U input
        order = self._names.order(keys)  # codes count first appearances: sort by the ids themselves
        return _strings.object_array(self._names.keys(keys[order])), totals[order]

    def _keyed(self) -> bool:
        """Whether shard ids are held as Python keys with codes (strings, or ints beyond int64 or beside strings)."""
        return self._id_kind in ("str", "object")

    def _validate(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> tuple[Array, ...]:
        shards, skind = _checks.as_ids("shard_ids", shard_ids, self._rows)
        workers, wkind = _checks.as_ids("worker_ids", worker_ids, self._rows)
        owners, okind = _checks.as_ids("owner_ids", owner_ids, self._rows)
        grads = _checks.as_gradients(gradients)
        names = ("shard_ids", "worker_ids", "owner_ids", "gradients")
        _checks.check_lengths(dict(zip(names, (len(shards), len(workers), len(owners), len(grads)))))
        if not wkind == okind == "int":  # tables compare ints: the exact Python compare becomes a 0/1 column
            same = _checks.owner_rows(workers, wkind, owners, okind)
            workers, owners = same.view(np.int8), np.ones(len(workers), dtype=np.int8)
        if skind == "str" and isinstance(shards, np.ndarray) and shards.dtype.kind == "U":
            skind = "fixed"  # a <U array (it cannot hold trailing NULs): sorted and merged as packed keys, no Python
        if len(shards) or _typed(shard_ids):  # an empty list says nothing about the id type
            shards, skind = self._check_consistent(shards, skind, grads)
        if skind == "int" and self._keyed():  # integer ids after keyed ones: held as keys too
            shards, skind = _strings.object_array(shards.tolist()), "object"
        if skind in ("int", "fixed"):
            return shards.astype(np.int64, copy=False) if skind == "int" else shards, workers, owners, grads
        return self._names.codes(shards), workers, owners, grads

    def _check_consistent(self, shards: Any, skind: str, grads: Array) -> tuple[Any, str]:
        """Later batches must keep the first batch's shard id type and gradient shape and dtype kind."""
        shape, dtype = grads.shape[1:], _checks.sum_dtype(grads)
        if self._id_kind is None:
            self._id_kind, self._shape, self._dtype = skind, shape, dtype
            return shards, skind
        if self._id_kind == "fixed" and skind == "str":  # strings after a <U array: as <U, if it can hold them
            shards, skind = _strings.as_fixed(shards, self._rows), "fixed"
        if self._id_kind == "int" and skind in ("str", "object", "fixed"):  # beyond int64, or strings: keys from now
            shards, skind = (_strings.object_array(shards.tolist()), "str") if skind == "fixed" else (shards, skind)
            self._hold_as_keys()
        if skind != self._id_kind and not self._keyed():
            said = {"fixed": "str (a <U array)", "object": "int and str"}
            raise UnorderableShardError(
                f"row {self._rows}: shard ids are {said.get(skind, skind)} in this batch but "
                f"{said.get(self._id_kind, self._id_kind)} in earlier rows; an accumulator that started on an "
                "integer column takes only integer ids, and one that started on a <U array only strings"
            )
        if skind != self._id_kind:
            self._id_kind = "object"  # strings and ints held as keys alike; only their order may fail, at the end
        if shape != self._shape:
            raise GradientShapeError(
                f"row {self._rows}: gradients are {_describe(shape)}, expected {_describe(self._shape)} (from row 0)"
            )
        if dtype != self._dtype:
            raise GradientTypeError(
                f"row {self._rows}: gradients are {grads.dtype.name} here but {self._dtype.name} totals before; "
                "feed one numeric kind (integers or floats)"
            )
        return shards, skind

    def _hold_as_keys(self) -> None:
        """Turn the integer table into one keyed by codes of the same ids (Python ints), totals untouched."""
        if self._table is not None:
            table = self._sorted(self._table) if isinstance(self._table, DenseTable) else self._table
            # Interned in ascending order, the codes are 0..k-1 in the keys' order: still a sorted table.
            table.keys = self._names.codes(_strings.object_array(table.keys.tolist()))
            self._table = table
        self._id_kind = "object"

    def _sorted(self, dense: DenseTable | None) -> SortedTable:
        assert self._shape is not None
        return SortedTable.from_dense(dense, self._id_kind == "fixed", self._shape, self._dtype, self._kernels)

    def _table_absmax(self) -> int:
        if self._table is None or self._dtype.kind != "i":
            return 0
        totals = self._table.result()[1]
        return int(np.abs(totals).max()) if totals.size else 0


def _typed(ids: Any) -> bool:
    """Whether an id column's dtype says int or str even when it is empty (an object array or a list does not)."""
    return isinstance(ids, np.ndarray) and ids.dtype.kind != "O"


def _describe(shape: tuple[int, ...] | None) -> str:
    return "scalars" if not shape else f"vectors of length {shape[0]}"


__all__ = ["ColumnarMean", "ColumnarOwnerSum", "microbatch_mean", "owner_sum"]
