"""NumPy backend: both contracts on NumPy arrays.

Owner-sum keeps a table of per-shard totals, in one of two layouts:

* dense: integer shard ids whose range is small (at most :data:`DENSE_LIMIT`
  table cells) index the table directly, ``totals[shard - lo]``, and one fused
  pass does compare, mask and add (the bincount idea, without its passes).
  The table grows when an id falls outside it, so no pass is spent finding the
  range first. Batches of at least two chunks of scalar gradients use a second
  core: it copies the owner rows of the batch's back half out of the way while
  the first core adds the front half, then the first core adds those copies,
  still chunk after chunk in row order;
* sorted: any other ids (strings, sparse integers, vectors too wide for a
  dense table) are factorised (:mod:`gradagg.backends._factor`): the owner
  rows' ids are sorted and made unique, merged into the table's sorted keys,
  and each row's gradient is added at its key's position.

Either way a shard's owner gradients are added one at a time in row order,
into a total that starts at ``-0.0`` (the one value with ``-0.0 + x == x`` for
every x, so the first row's value is kept exactly, sign of zero included):
float totals are bit-identical to :func:`gradagg.reference.owner_sum`.

The fused loops are numba kernels (:mod:`gradagg.backends._kernels`); without
numba, or with :data:`USE_KERNELS` set to False, the same steps run as NumPy
calls (``np.add.at`` is also unbuffered and in row order).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gradagg.backends import _checks, _factor, _kernels
from gradagg.errors import GradientShapeError, GradientTypeError, RowShapeError, UnorderableShardError

Array = NDArray[Any]

# Table cells (shards x vector width) up to which integer ids index a dense
# table: 2^24 float64 cells are 128 MiB, small next to a 10^7-row input.
DENSE_LIMIT = 1 << 24
# Use the numba kernels when numba is installed; tests switch this off to
# check the pure NumPy path gives the same answers.
USE_KERNELS: bool = _kernels.AVAILABLE
# Smallest chunk when a scalar batch is split between two cores (batches of two chunks or more are
# split, into about ten chunks: record batches of a Parquet file, ~10^5-10^6 rows, qualify too).
_CHUNK = 1 << 17
# Vector gradients of at least this many values are added into a sorted table by two threads, half the
# components each (each owner row's components are far apart in memory there, so two cores fetch faster).
SPLIT_MIN = 1 << 22
# Parameters per block in the NumPy microbatch path: keeps the float64 sums in L2.
_MEAN_BLOCK = 1 << 16


def owner_sum(
    shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any, *, nonfinite: str = "propagate"
) -> tuple[Array, Array]:
    """Owner-only shard reduction on NumPy columns (see :func:`gradagg.engine.owner_sum_columns`).

    Args:
        shard_ids: N int or str ids (integer, ``<U`` or object array, or a list).
        worker_ids: N worker ids.
        owner_ids: N owner ids, of the same type as ``worker_ids``.
        gradients: ``(N,)`` or ``(N, D)`` integers or floats.
        nonfinite: ``"propagate"`` or ``"raise"``.

    Returns:
        ``(shards, totals)``: sorted shards with an owner row; int64 or float64 totals.

    Raises:
        GradaggError: see :func:`gradagg.engine.owner_sum_columns`.

    >>> s, t = owner_sum(np.array([3, 3, 1]), np.array([0, 1, 2]), np.array([0, 0, 2]), np.array([1.0, 9.0, 2.0]))
    >>> s.tolist(), t.tolist()
    ([1, 3], [2.0, 1.0])
    """
    acc = OwnerSumAccumulator(nonfinite=nonfinite)
    acc.update(shard_ids, worker_ids, owner_ids, gradients)
    return acc.result()


def microbatch_mean(values: Any, present: Any = None, *, nonfinite: str = "propagate") -> Any:
    """Microbatch mean on NumPy input (see :func:`gradagg.engine.microbatch_mean_columns`).

    Args:
        values: ``(M, P)`` array, or a list of M lists of P arrays/numbers/``None``.
        present: ``(M, P)`` boolean mask for array input; ``None`` = all present.
        nonfinite: ``"propagate"`` or ``"raise"``.

    Returns:
        ``(P,)`` float64 means (divisor M), or a list of P float64 arrays for list input.

    Raises:
        GradaggError: see :func:`gradagg.engine.microbatch_mean_columns`.

    >>> microbatch_mean([[2.0, None], [4.0, 6.0]])
    [array(3.), array(3.)]
    """
    if isinstance(values, (list, tuple)):
        _checks.check_nonfinite_option(nonfinite)
        return _mean_of_lists(values, nonfinite)
    _checks.check_nonfinite_option(nonfinite)
    v, mask = _checks.as_values_and_mask(values, present)
    if nonfinite == "raise":
        _checks.check_finite_values(v, mask, 0)
    if v.shape[0] == 0:
        return np.empty(0, dtype=np.float64)  # no microbatch: the reference's []
    means = np.zeros(v.shape[1], dtype=np.float64)
    _add_rows(means, v, mask, divisor=v.shape[0])  # the divisor is M, counted, nothing else
    return means


class OwnerSumAccumulator:
    """Owner-sum fed in batches; memory grows with distinct shards (or their range), not rows.

    Summation order: every shard's total adds its owner gradients one by one
    in the order rows were fed, across updates (see the module notes).

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.

    >>> acc = OwnerSumAccumulator()
    >>> acc.update(np.array(["a"]), np.array([0]), np.array([0]), np.array([[1, 2]]))
    >>> acc.update(np.array(["a"]), np.array([1]), np.array([1]), np.array([[3, 4]]))
    >>> [x.tolist() for x in acc.result()]
    [['a'], [[4, 6]]]
    """

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        _checks.check_nonfinite_option(nonfinite)
        self._nonfinite = nonfinite
        self._rows = 0  # rows fed so far: the offset of the next batch's row numbers
        self._id_kind: str | None = None
        self._shape: tuple[int, ...] | None = None  # () for scalar gradients, (D,) for vectors
        self._dtype: Any = None
        self._table: _DenseTable | _SortedTable | None = None

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
        start = self._add_dense(shards, workers, owners, grads, owned)
        if isinstance(self._table, _SortedTable):  # strings, sparse ids, or the rows after a dense table overflowed
            rest = slice(start, None)
            owned_rest = None if owned is None else owned[rest]
            self._table.add(shards[rest], workers[rest], owners[rest], grads[rest], owned_rest)
        self._rows += shards.shape[0]

    def _owned_if_needed(self, shards: Array, workers: Array, owners: Array, grads: Array) -> Array | None:
        """The owner-row mask, computed only for the checks that need it (the fused kernels do without)."""
        if self._nonfinite != "raise" and grads.dtype.kind != "i":
            return None
        owned: Array = np.equal(workers, owners)
        if self._nonfinite == "raise":
            _checks.first_nonfinite(owned, grads, shards, self._rows)
        if grads.dtype.kind == "i":
            _checks.check_int_headroom(grads[owned], int(owned.sum()), self._table_absmax())
        return owned

    def _add_dense(self, shards: Array, workers: Array, owners: Array, grads: Array, owned: Array | None) -> int:
        """Add rows into the dense table, growing it as ids require; return the row where a sorted table takes over."""
        if self._table is None:
            self._table = _DenseTable(0, 0, self._shape or (), self._dtype) if self._id_kind == "int" else None
        n = len(shards)
        if USE_KERNELS and grads.ndim == 1 and n >= 2 * _CHUNK and isinstance(self._table, _DenseTable):
            return self._dense_two_cores(shards, workers, owners, grads)
        stop = self._dense_rows(0, n, shards, workers, owners, grads, owned)
        if self._table is None:
            self._table = self._sorted(None)
        return stop

    def _dense_rows(
        self, start: int, stop: int, shards: Array, workers: Array, owners: Array, grads: Array, owned: Array | None
    ) -> int:
        """Rows ``start:stop`` into the dense table, growing it; the row where a sorted table takes over, or stop."""
        cut = slice(0, stop)
        columns = (shards[cut], workers[cut], owners[cut], grads[cut], None if owned is None else owned[cut])
        while isinstance(self._table, _DenseTable):
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
        work = _TwoEnds(len(shards))
        helper = _pool().submit(work.compact_from_back, shards, workers, owners, grads)
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
        while isinstance(self._table, _DenseTable):
            stop = int(_kernels.dense_owned(shards, grads, start, self._table.lo, self._table.totals, self._table.seen))
            if stop == len(shards):
                return
            start = stop
            grown = self._table.grown(int(shards[stop]), int(shards[stop]))
            self._table = grown if grown is not None else self._sorted(self._table)
        ones = np.ones(len(shards) - start, dtype=bool)
        assert isinstance(self._table, _SortedTable)  # the only other layout
        self._table.add(shards[start:], ones, ones, grads[start:], ones)

    def result(self) -> tuple[Array, Array]:
        """Return ``(shards, totals)`` over all rows fed so far, shards sorted ascending.

        Returns:
            Sorted shard ids (int64 or ``<U``) and their int64 or float64 totals.
        """
        if self._table is None:
            shards = np.empty(0, dtype="<U1" if self._id_kind == "str" else np.int64)
            return shards, np.empty((0, *(self._shape or ())), dtype=self._dtype or np.float64)
        return self._table.result()

    def _validate(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> tuple[Array, ...]:
        shards, skind = _checks.as_ids("shard_ids", shard_ids, self._rows)
        workers, wkind = _checks.as_ids("worker_ids", worker_ids, self._rows)
        owners, okind = _checks.as_ids("owner_ids", owner_ids, self._rows)
        grads = _checks.as_gradients(gradients)
        names = ("shard_ids", "worker_ids", "owner_ids", "gradients")
        _checks.check_lengths(dict(zip(names, (len(shards), len(workers), len(owners), len(grads)))))
        _checks.check_same_id_kind(wkind, okind)
        if workers.dtype.kind == "U":  # kernels compare ints: turn a string compare into a 0/1 column
            workers, owners = (workers == owners).view(np.int8), np.ones(len(workers), dtype=np.int8)
        self._check_consistent(skind, grads)
        return shards.astype(np.int64, copy=False) if skind == "int" else shards, workers, owners, grads

    def _check_consistent(self, skind: str, grads: Array) -> None:
        """Later batches must keep the first batch's shard id type and gradient shape and dtype kind."""
        shape, dtype = grads.shape[1:], _total_dtype(grads)
        if self._id_kind is None:
            self._id_kind, self._shape, self._dtype = skind, shape, dtype
            return
        if skind != self._id_kind:
            raise UnorderableShardError(
                f"row {self._rows}: shard ids are {skind} in this batch but {self._id_kind} in earlier rows; "
                "int and str ids cannot be ordered against each other"
            )
        if shape != self._shape:
            raise GradientShapeError(
                f"row {self._rows}: gradients are {_describe(shape)}, expected {_describe(self._shape)} (from row 0)"
            )
        if dtype != self._dtype:
            raise GradientTypeError(
                f"row {self._rows}: gradients are {grads.dtype.name} here but {self._dtype.name} totals before; "
                "feed one numeric kind (integers or floats)"
            )

    def _sorted(self, dense: _DenseTable | None) -> _SortedTable:
        assert self._shape is not None
        return _SortedTable.from_dense(dense, self._id_kind == "str", self._shape, self._dtype)

    def _table_absmax(self) -> int:
        if self._table is None or self._dtype.kind != "i":
            return 0
        totals = self._table.result()[1]
        return int(np.abs(totals).max()) if totals.size else 0


def _total_dtype(grads: Array) -> Any:
    return np.dtype(np.int64) if grads.dtype.kind == "i" else np.dtype(np.float64)


def _describe(shape: tuple[int, ...] | None) -> str:
    return "scalars" if not shape else f"vectors of length {shape[0]}"


def _add_at(totals: Array, codes: Array, values: Array) -> None:
    """``totals[codes[i]] += values[i]`` in row order, without numba (``ufunc.at`` is unbuffered and ordered).

    ``np.add.at`` on 2-D rows runs per row (~10x slower than per column), so
    vectors are added one component at a time, on float64 column copies.
    """
    if values.ndim == 1:
        np.add.at(totals, codes, values)
        return
    columns = np.ascontiguousarray(values.T, dtype=totals.dtype)
    per_column = np.ascontiguousarray(totals.T)
    for k in range(len(columns)):
        np.add.at(per_column[k], codes, columns[k])
    totals[...] = per_column.T


def _by_components(kernel: Any, grads: Array, *args: Any) -> list[Any]:
    """Run a vector kernel over component ranges ``k0:k1``: both halves at once on two cores for big inputs."""
    width = grads.shape[1]
    if grads.size < SPLIT_MIN or width < 2:
        return [kernel(*args, 0, width)]
    half = width // 2
    other = _pool().submit(lambda: kernel(*args, half, width))
    first = kernel(*args, 0, half)
    return [first, other.result()]


def _lookup() -> Any:
    """The compiled id lookup for :func:`_factor.factorize`, when kernels are on."""
    return _kernels.lookup_codes if USE_KERNELS else None


def _new_totals(n: int, shape: tuple[int, ...], dtype: Any) -> Array:
    # -0.0 is the identity of float addition including the sign of zero (0.0 + -0.0 is +0.0).
    return np.full((n, *shape), -0.0 if dtype.kind == "f" else 0, dtype=dtype)


class _TwoEnds:
    """Chunks of a batch claimed from the front (fused adds) and from the back (compaction), under one lock."""

    def __init__(self, n: int) -> None:
        size = max(_CHUNK, n // 10)
        self.bounds = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
        self.front, self.back = 0, len(self.bounds)
        self.lock = threading.Lock()
        self.results: list[tuple[Array, Array] | None] = [None] * len(self.bounds)
        self.ready = [threading.Event() for _ in self.bounds]

    def claim_from_front(self) -> Iterator[tuple[int, int]]:
        while True:
            with self.lock:
                if self.front >= self.back:
                    return
                self.front += 1
            yield self.bounds[self.front - 1]

    def compact_from_back(self, shards: Array, workers: Array, owners: Array, grads: Array) -> None:
        while True:
            with self.lock:
                if self.back - 1 < self.front:
                    return
                self.back -= 1
                k = self.back
            lo, hi = self.bounds[k]
            out = (np.empty(hi - lo, dtype=np.int64), np.empty(hi - lo, dtype=grads.dtype))
            rows = slice(lo, hi)
            count = _kernels.compact_owned(shards[rows], workers[rows], owners[rows], grads[rows], *out)
            self.results[k] = (out[0][:count], out[1][:count])
            self.ready[k].set()

    def cancel(self) -> None:
        with self.lock:
            self.back = self.front

    def compacted(self) -> Iterator[tuple[Array, Array]]:
        """The back chunks' owner rows, in chunk order (waiting for each)."""
        for k in range(self.front, len(self.bounds)):
            self.ready[k].wait()
            result = self.results[k]
            assert result is not None  # set before the event
            yield result


class _DenseTable:
    """Totals for integer shard ids ``lo .. lo + span - 1``, indexed directly; ``seen`` marks owner rows."""

    def __init__(self, lo: int, span: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.lo, self.span, self.shape, self.dtype = lo, span, shape, dtype
        self.totals = _new_totals(span, shape, dtype)
        self.seen = np.zeros(span, dtype=np.uint8)

    def grown(self, lo: int, hi: int) -> _DenseTable | None:
        """A copy covering ids ``lo .. hi`` too, at least doubled (few regrowths); None past DENSE_LIMIT."""
        need_lo, need_hi = (min(lo, self.lo), max(hi, self.lo + self.span - 1)) if self.span else (lo, hi)
        span = max(need_hi - need_lo + 1, 2 * self.span, 1024)
        if span * int(np.prod(self.shape, dtype=np.int64)) > DENSE_LIMIT:
            return None
        # Grow away from the side that overflowed, so ids arriving in order keep fitting.
        new_lo = need_hi - span + 1 if self.span and lo < self.lo else need_lo
        new = _DenseTable(new_lo, span, self.shape, self.dtype)
        at = self.lo - new_lo
        new.totals[at : at + self.span] = self.totals  # the totals keep their bits and their row order
        new.seen[at : at + self.span] = self.seen
        return new

    def add(
        self, start: int, shards: Array, workers: Array, owners: Array, grads: Array, owned: Array | None
    ) -> tuple[int, int, int] | None:
        """Add owner rows from ``start`` on; or stop at row r and return ``(r, lo, hi)``, the ids to make room for."""
        if USE_KERNELS:
            table = (self.lo, self.totals, self.seen)
            if grads.ndim == 1:
                stop = int(_kernels.dense_scalar(shards, workers, owners, grads, start, *table))
            else:
                # One thread: splitting components measured slower here (both threads re-read the id columns).
                stop = int(_kernels.dense_vector(shards, workers, owners, grads, start, *table, 0, grads.shape[1]))
            return None if stop == len(shards) else (stop, int(shards[stop]), int(shards[stop]))
        owned = workers == owners if owned is None else owned
        ids = shards[owned]
        if ids.size and (ids.min() < self.lo or ids.max() >= self.lo + self.span):
            return start, int(ids.min()), int(ids.max())  # grow once to the whole range, then add all
        _add_at(self.totals, ids - self.lo, grads[owned])
        self.seen[ids - self.lo] = 1
        return None

    def result(self) -> tuple[Array, Array]:
        present = self.seen.view(bool)
        return np.flatnonzero(present) + self.lo, self.totals[present]


class _SortedTable:
    """Totals for any ids: ``keys`` sorted and unique, ``totals[k]`` belonging to ``keys[k]``."""

    def __init__(self, keys: Array, shape: tuple[int, ...], dtype: Any) -> None:
        self.keys = keys
        self.totals = _new_totals(len(keys), shape, dtype)
        self.shape, self.dtype = shape, dtype

    @classmethod
    def from_dense(cls, dense: _DenseTable | None, strings: bool, shape: tuple[int, ...], dtype: Any) -> _SortedTable:
        if dense is None:
            return cls(np.empty(0, dtype="<U1" if strings else np.int64), shape, dtype)
        keys, totals = dense.result()
        table = cls(keys, shape, dtype)
        table.totals = totals.copy()
        return table

    def add(self, shards: Array, workers: Array, owners: Array, grads: Array, owned: Array | None) -> None:
        rows = np.flatnonzero(workers == owners if owned is None else owned)
        keys, inverse = _factor.factorize(shards[rows], _lookup())
        codes = self._merge(keys)[inverse]
        if USE_KERNELS and len(codes) and grads.ndim == 1:
            _kernels.codes_scalar(rows, codes, grads, self.totals)
        elif USE_KERNELS and len(codes):
            _by_components(_kernels.codes_vector, grads, rows, codes, grads, self.totals)
        else:
            _add_at(self.totals, codes, grads[rows])

    def _merge(self, keys: Array) -> Array:
        """Make room for new keys; return each of ``keys``' position in the (updated) table."""
        if not len(self.keys):
            self.keys, self.totals = keys, _new_totals(len(keys), self.shape, self.dtype)
            return np.arange(len(keys))
        # Factorising old and new keys together: for strings this avoids searching sorted
        # strings (a Python-style compare per step); for ints, np.union1d's hashing (slow in numpy 2.4).
        merged, inverse = _factor.factorize(np.concatenate([self.keys, keys]), _lookup())
        old_pos, new_pos = inverse[: len(self.keys)], inverse[len(self.keys) :]
        if len(merged) != len(self.keys):
            totals = _new_totals(len(merged), self.shape, self.dtype)
            totals[old_pos] = self.totals
            self.keys, self.totals = merged, totals
        return new_pos

    def result(self) -> tuple[Array, Array]:
        return self.keys, self.totals


class MicrobatchMeanAccumulator:
    """Microbatch mean fed k microbatches at a time: float64 sums per parameter, divided by M at the end.

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.

    >>> acc = MicrobatchMeanAccumulator()
    >>> acc.update(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[True, False], [True, True]]))
    >>> acc.result().tolist()
    [2.0, 2.0]
    """

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        _checks.check_nonfinite_option(nonfinite)
        self._nonfinite = nonfinite
        self._sums: Array | None = None
        self._m = 0  # the divisor: microbatches counted, nothing else

    def update(self, values: Any, present: Any = None) -> None:
        """Add k microbatches: ``values`` ``(k, P)`` and ``present`` ``(k, P)`` booleans (None = all).

        Args:
            values: as for :func:`microbatch_mean`.
            present: as for :func:`microbatch_mean`.

        Raises:
            GradaggError: see :func:`microbatch_mean`; also P differing from earlier batches.
        """
        v, mask = _checks.as_values_and_mask(values, present)
        if self._nonfinite == "raise":
            _checks.check_finite_values(v, mask, self._m)
        if self._sums is None:
            self._sums = np.zeros(v.shape[1], dtype=np.float64)  # +0.0, as the reference's int 0 start
        elif v.shape[1] != len(self._sums):
            raise RowShapeError(
                f"microbatch {self._m}: has {v.shape[1]} values, expected {len(self._sums)} (from microbatch 0)"
            )
        _add_rows(self._sums, v, mask)
        self._m += v.shape[0]

    def result(self) -> Array:
        """Return the ``(P,)`` float64 means: sums divided by the M microbatches fed.

        Returns:
            The means; an empty array when no microbatch was fed (as the reference).
        """
        if self._sums is None or self._m == 0:
            return np.empty(0, dtype=np.float64)
        return self._sums / self._m


def _add_rows(sums: Array, values: Array, present: Array | None, divisor: int = 0) -> None:
    """``sums += values`` where present, microbatch by microbatch (each element in microbatch order).

    A non-zero ``divisor`` then divides the sums in place (the one-shot mean).
    """
    if USE_KERNELS and values.size and (present is None or values.dtype.kind == "f"):
        ranges = _kernels.column_ranges(values.shape[1], values.size)
        if len(ranges) == 1:
            _kernel_rows(sums, values, present, divisor, *ranges[0])
        else:
            list(_pool().map(lambda r: _kernel_rows(sums, values, present, divisor, *r), ranges))
        return
    # Blocks keep the float64 sums in cache; `where=` adds without a masked temporary.
    for start in range(0, values.shape[1], _MEAN_BLOCK):
        block = slice(start, start + _MEAN_BLOCK)
        for i in range(values.shape[0]):
            where = True if present is None else present[i, block]
            np.add(sums[block], values[i, block], out=sums[block], where=where)
    if divisor:
        sums /= divisor


def _kernel_rows(sums: Array, values: Array, present: Array | None, divisor: int, start: int, stop: int) -> None:
    if present is None:
        _kernels.rows_sum(values, sums, start, stop, float(divisor))
        return
    bits = np.dtype(f"u{values.dtype.itemsize}")
    scratch = np.empty((4, _kernels.BLOCK), dtype=values.dtype)
    masks = (present.view(np.uint8), scratch.view(bits), scratch)
    _kernels.masked_rows_sum(values.view(bits), masks[0], sums, start, stop, masks[1], masks[2], float(divisor))


_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    """One pool for the process: starting threads per call cost milliseconds on a busy machine."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(4, thread_name_prefix="gradagg"))
    return _POOL[0]


def _mean_of_lists(rows: Any, nonfinite: str) -> list[Array]:
    """The list-of-lists form: per parameter, a float64 sum of its present arrays over M."""
    m = len(rows)
    width = len(rows[0]) if m else 0
    out = []
    for j in range(width):
        total: Array | None = None
        first = 0
        for i, row in enumerate(rows):
            if len(row) != width:
                raise RowShapeError(f"microbatch {i}: has {len(row)} values, expected {width} (from microbatch 0)")
            if row[j] is None:
                continue  # absent: contributes zero, still counted in M
            value = _checks.widen(np.asarray(row[j]), f"microbatch {i}, parameter {j}")
            if nonfinite == "raise":
                _checks.check_finite_item(value, f"microbatch {i}, parameter {j}")
            if total is None:
                total, first = np.zeros(value.shape, dtype=np.float64), i
            elif value.shape != total.shape:
                raise GradientShapeError(
                    f"microbatch {i}, parameter {j}: shape {value.shape}, "
                    f"expected {total.shape} (from microbatch {first})"
                )
            total += value
        out.append(np.zeros((), dtype=np.float64) if total is None else np.asarray(total / m))
    return out
