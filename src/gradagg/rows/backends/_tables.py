"""The owner-sum tables of the NumPy backend: dense (integer ids index it) and sorted (any integer ids).

See :mod:`gradagg.rows.backends.numpy` for how the backend uses them. Each adds a
shard's owner gradients one at a time in row order into totals that start at
``-0.0``: with the fused numba loops of :mod:`gradagg.rows.backends._kernels` when
a table is given them (``kernels``, the ``numba`` engine), else with
``np.add.at`` (unbuffered, in row order too).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gradagg.rows.backends import _checks, _factor

Array = NDArray[Any]

# Table cells (shards x vector width) up to which integer ids index a dense
# table: 2^24 float64 cells are 128 MiB, small next to a 10^7-row input.
DENSE_LIMIT = 1 << 24
# Smallest chunk when a scalar batch is split between two cores by the kernels (batches of two chunks or
# more are split, into about ten chunks: record batches of a Parquet file qualify too).
CHUNK = 1 << 17
# Vector gradients of at least this many values are added into a sorted table by two threads, half the
# components each (each owner row's components are far apart in memory there, so two cores fetch faster).
SPLIT_MIN = 1 << 22

def add_at(totals: Array, codes: Array, values: Array) -> None:
    """``totals[codes[i]] += values[i]`` in row order (``ufunc.at`` is unbuffered and ordered).

    ``np.add.at`` on 2-D rows runs per row (much slower than per column), so
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


def by_components(kernel: Any, grads: Array, kernels: Any, *args: Any) -> list[Any]:
    """Run a vector kernel over component ranges ``k0:k1``: both halves at once on two cores for big inputs."""
    width = grads.shape[1]
    if grads.size < SPLIT_MIN or width < 2:
        return [kernel(*args, 0, width)]
    half = width // 2
    other = kernels.pool().submit(lambda: kernel(*args, half, width))
    first = kernel(*args, 0, half)
    return [first, other.result()]


def new_totals(n: int, shape: tuple[int, ...], dtype: Any) -> Array:
    # -0.0 is the identity of float addition including the sign of zero (0.0 + -0.0 is +0.0).
    return np.full((n, *shape), -0.0 if dtype.kind == "f" else 0, dtype=dtype)


class TwoEnds:
    """Chunks of a batch claimed from the front (fused adds) and from the back (compaction), under one lock."""

    def __init__(self, n: int, kernels: Any) -> None:
        size = max(CHUNK, n // 10)
        self.bounds = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
        self.front, self.back = 0, len(self.bounds)
        self.lock = threading.Lock()
        self.kernels = kernels
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
            count = self.kernels.compact_owned(shards[rows], workers[rows], owners[rows], grads[rows], *out)
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


class DenseTable:
    """Totals for integer shard ids ``lo .. lo + span - 1``, indexed directly; ``seen`` marks owner rows."""

    def __init__(self, lo: int, span: int, shape: tuple[int, ...], dtype: Any, kernels: Any = None) -> None:
        self.lo, self.span, self.shape, self.dtype = lo, span, shape, dtype
        self.kernels = kernels  # gradagg.rows.backends._kernels (the numba engine), or None: NumPy calls
        self.totals = new_totals(span, shape, dtype)
        self.seen = np.zeros(span, dtype=np.uint8)

    def grown(self, lo: int, hi: int) -> DenseTable | None:
        """A copy covering ids ``lo .. hi`` too, at least doubled (few regrowths); None past DENSE_LIMIT."""
        need_lo, need_hi = (min(lo, self.lo), max(hi, self.lo + self.span - 1)) if self.span else (lo, hi)
        span = max(need_hi - need_lo + 1, 2 * self.span, 1024)
        if span * int(np.prod(self.shape, dtype=np.int64)) > DENSE_LIMIT:
            return None
        # Grow away from the side that overflowed, so ids arriving in order keep fitting; and stay inside int64,
        # since the kernels compute shard - lo in int64.
        new_lo = need_hi - span + 1 if self.span and lo < self.lo else need_lo
        new_lo = max(_checks.INT64_MIN, min(new_lo, _checks.INT64_MAX - span + 1))
        new = DenseTable(new_lo, span, self.shape, self.dtype, self.kernels)
        at = self.lo - new_lo
        new.totals[at : at + self.span] = self.totals  # the totals keep their bits and their row order
        new.seen[at : at + self.span] = self.seen
        return new

    def add(
        self, start: int, shards: Array, workers: Array, owners: Array, grads: Array, owned: Array | None
    ) -> tuple[int, int, int] | None:
        """Add owner rows from ``start`` on; or stop at row r and return ``(r, lo, hi)``, the ids to make room for."""
        if self.kernels is not None:
            table = (self.lo, self.totals, self.seen)
            if grads.ndim == 1:
                stop = int(self.kernels.dense_scalar(shards, workers, owners, grads, start, *table))
            else:
                # One thread: splitting components measured slower here (both threads re-read the id columns).
                stop = int(self.kernels.dense_vector(shards, workers, owners, grads, start, *table, 0, grads.shape[1]))
            return None if stop == len(shards) else (stop, int(shards[stop]), int(shards[stop]))
        # Row numbers, then take: a boolean mask over random rows indexes slower than this in numpy 2.4.
        rows = np.flatnonzero(workers[start:] == owners[start:] if owned is None else owned[start:])
        if start:
            rows += start
        ids = shards.take(rows)
        low, high = (int(ids.min()), int(ids.max())) if ids.size else (self.lo, self.lo)
        if low < self.lo or high >= self.lo + self.span:
            return start, low, high  # grow once to the whole range, then add all
        if self.lo:
            ids -= self.lo
        add_at(self.totals, ids, grads.take(rows, axis=0))
        self.seen[ids] = 1
        return None

    def result(self) -> tuple[Array, Array]:
        present = self.seen.view(bool)
        return np.flatnonzero(present) + self.lo, self.totals[present]


class SortedTable:
    """Totals for any integer or ``<U`` ids: ``keys`` sorted and unique, ``totals[k]`` belonging to ``keys[k]``."""

    def __init__(self, keys: Array, shape: tuple[int, ...], dtype: Any, kernels: Any = None) -> None:
        self.keys = keys
        self.totals = new_totals(len(keys), shape, dtype)
        self.shape, self.dtype = shape, dtype
        self.kernels = kernels  # as DenseTable's

    @classmethod
    def from_dense(
        cls, dense: DenseTable | None, strings: bool, shape: tuple[int, ...], dtype: Any, kernels: Any = None
    ) -> SortedTable:
        if dense is None:
            return cls(np.empty(0, dtype="<U1" if strings else np.int64), shape, dtype, kernels)
        keys, totals = dense.result()
        table = cls(keys, shape, dtype, kernels)
        table.totals = totals.copy()
        return table

    def add(self, shards: Array, workers: Array, owners: Array, grads: Array, owned: Array | None) -> None:
        rows = np.flatnonzero(workers == owners if owned is None else owned)
        keys, inverse = _factor.factorize(shards[rows], self._lookup())
        codes = self._merge(keys)[inverse]
        k = self.kernels
        if k is not None and len(codes) and grads.ndim == 1:
            k.codes_scalar(rows, codes, grads, self.totals)
        elif k is not None and len(codes):
            by_components(k.codes_vector, grads, k, rows, codes, grads, self.totals)
        else:
            add_at(self.totals, codes, grads[rows])

    def _lookup(self) -> Any:
        """The compiled id lookup for :func:`_factor.factorize`, with the kernels."""
        return None if self.kernels is None else self.kernels.lookup_codes

    def _merge(self, keys: Array) -> Array:
        """Make room for new keys; return each of ``keys``' position in the (updated) table."""
        if not len(self.keys):
            self.keys, self.totals = keys, new_totals(len(keys), self.shape, self.dtype)
            return np.arange(len(keys))
        # Factorising old and new keys together: for <U ids this avoids searching sorted strings (a
        # Python-style compare per step); for ints, np.union1d's hashing (slow in numpy 2.4).
        merged, inverse = _factor.factorize(np.concatenate([self.keys, keys]), self._lookup())
        old_pos, new_pos = inverse[: len(self.keys)], inverse[len(self.keys) :]
        if len(merged) != len(self.keys):
            totals = new_totals(len(merged), self.shape, self.dtype)
            totals[old_pos] = self.totals
            self.keys, self.totals = merged, totals
        return new_pos

    def result(self) -> tuple[Array, Array]:
        return self.keys, self.totals
