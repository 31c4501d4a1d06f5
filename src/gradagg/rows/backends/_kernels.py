"""Fused one-pass kernels for the NumPy backend, compiled by numba: the ``engine="numba"`` backend's loops.

Why a compiler: the owner-sum is ``totals[shard] += gradient where worker ==
owner``. In NumPy that takes a compare pass, a masking pass and a scatter pass,
each reading or writing a full column; the fused loop below reads each column
once. Every kernel adds a shard's rows one at a time **in row order**, which is
what makes float totals bit-identical to the pure-Python reference.

This module imports numba (an ImportError without it): only
:mod:`gradagg.rows.backends.numba` imports it, and hands it to the NumPy backend's
tables as their ``kernels``; ``engine="numpy"`` never loads it. Kernels are
compiled on first use and cached on disk (``cache=True``), so later processes
start fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numba
import numpy as np

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

# Parameters per block in the microbatch mean: 4 Ki float64 sums (32 KiB) stay
# in L1 while all M microbatches are added into them.
BLOCK = 1 << 12
# Rows per block of the owner-sum's fused pass: the block's owner-row indices (16 KiB) stay in L1.
_ROWS = 1 << 11


def _jit() -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit`` with caching, releasing the GIL (the kernels run on two threads at times)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        return numba.njit(cache=True, nogil=True)(fn)

    return wrap


def column_ranges(p: int, size: int) -> list[tuple[int, int]]:
    """Split P parameters into one column range per core for big inputs (one range for small ones).

    Parameters are independent, so ranges can run on separate threads (the
    kernels release the GIL) without changing any element's summation order.
    Plain threads rather than ``parallel=True``: parfors stopped LLVM from
    vectorising these loops.
    """
    parts = 1 if size < (1 << 22) else min(4, max(1, os.cpu_count() or 1))
    step = -(-p // parts) // BLOCK * BLOCK + BLOCK
    return [(lo, min(p, lo + step)) for lo in range(0, p, step)]


@_jit()
def dense_scalar(
    shards: Any, workers: Any, owners: Any, gradients: Any, start: int, lo: int, totals: Any, seen: Any
) -> int:
    """``totals[shard - lo] += g`` for owner rows from ``start`` on, in row order; ``seen`` marks shards.

    Stops at the first owner row whose shard falls outside the table and
    returns its index (the caller grows the table and resumes there), or
    returns N when done. So no separate pass is needed to find the id range.
    Rows go in blocks: first the indices of a block's owner rows are listed
    without a branch (the index is always written, the count grows only on an
    owner row), then those rows are added. A branch on ownership per row is
    mispredicted whenever owners and replicas interleave; a branch-free
    "replica slot" made every replica row wait on the previous one's add.
    """
    hi = lo + (totals.shape[0] - 1)  # the caller keeps lo .. hi inside int64; shard - lo could overflow
    n = shards.shape[0]
    rows = np.empty(_ROWS, dtype=np.int64)
    for first in range(start, n, _ROWS):
        k = 0
        for i in range(first, min(first + _ROWS, n)):
            rows[k] = i
            k += workers[i] == owners[i]
        for q in range(k):
            i = rows[q]
            shard = shards[i]
            if shard < lo or shard > hi:
                return int(i)
            totals[shard - lo] += gradients[i]
            seen[shard - lo] = 1
    return int(n)


@_jit()
def dense_owned(shards: Any, gradients: Any, start: int, lo: int, totals: Any, seen: Any) -> int:
    """:func:`dense_scalar` for rows already known to be the owners' (from :func:`compact_owned`)."""
    hi = lo + (totals.shape[0] - 1)
    for i in range(start, shards.shape[0]):
        shard = shards[i]
        if shard < lo or shard > hi:
            return i
        totals[shard - lo] += gradients[i]
        seen[shard - lo] = 1
    return int(shards.shape[0])


@_jit()
def compact_owned(shards: Any, workers: Any, owners: Any, gradients: Any, out_shards: Any, out_gradients: Any) -> int:
    """Copy the owner rows' shard ids and gradients, in row order, to the front of the outputs; return how many.

    Run on a second core while the first adds earlier rows: the adding thread
    then reads 16 bytes per owner row instead of 32 bytes per row. The outputs
    hold as many rows as the inputs (every row is written before it is kept or not).
    """
    k = 0
    for i in range(shards.shape[0]):  # without a branch: every row is written, only an owner row is kept
        out_shards[k] = shards[i]
        out_gradients[k] = gradients[i]
        k += workers[i] == owners[i]
    return k


@_jit()
def dense_vector(
    shards: Any, workers: Any, owners: Any, gradients: Any, start: int, lo: int, totals: Any, seen: Any,
    k0: int, k1: int,
) -> int:
    """Vector form of :func:`dense_scalar` on components ``k0:k1``: ``totals[shard - lo, k] += g[i, k]``.

    Components are independent sums, so two threads can take one half of them
    each (same rows, same order per component, same stopping row). Each row is
    first widened into a float64 buffer, then added: two simple loops that
    vectorise, where one mixed-precision loop does not.
    """
    hi = lo + (totals.shape[0] - 1)
    wide = np.empty(k1 - k0, dtype=totals.dtype)
    for i in range(start, shards.shape[0]):
        if workers[i] == owners[i]:
            if shards[i] < lo or shards[i] > hi:
                return i
            j = shards[i] - lo
            row = gradients[i, k0:k1]
            total = totals[j, k0:k1]
            for k in range(row.shape[0]):
                wide[k] = row[k]
            for k in range(row.shape[0]):
                total[k] += wide[k]
            seen[j] = 1
    return int(shards.shape[0])


@_jit()
def codes_scalar(rows: Any, codes: Any, gradients: Any, totals: Any) -> None:
    """``totals[codes[i]] += gradients[rows[i]]`` over the owner rows, in row order.

    Taking row numbers instead of a gathered copy of the owner rows' gradients
    saves writing and re-reading them.
    """
    for i in range(codes.shape[0]):
        totals[codes[i]] += gradients[rows[i]]


@_jit()
def codes_vector(rows: Any, codes: Any, gradients: Any, totals: Any, k0: int, k1: int) -> None:
    """Vector form of :func:`codes_scalar`, on components ``k0:k1`` (see :func:`dense_vector`)."""
    wide = np.empty(k1 - k0, dtype=totals.dtype)
    for i in range(codes.shape[0]):
        row = gradients[rows[i], k0:k1]
        total = totals[codes[i], k0:k1]
        for k in range(row.shape[0]):
            wide[k] = row[k]
        for k in range(row.shape[0]):
            total[k] += wide[k]


@_jit()
def lookup_codes(uniques: Any, ids: Any, codes: Any) -> None:
    """``codes[i]`` = position of ``ids[i]`` in the sorted, distinct ``uniques`` (every id must be there).

    An open-addressing hash table (Fibonacci hashing, linear probing, at most
    half full): one random access per id, where ``np.searchsorted`` on
    unsorted ids pays a cache miss per bisection step and ``np.argsort`` of
    int64 is much slower than ``np.sort``.
    """
    bits = 1
    while (1 << bits) < 2 * uniques.shape[0]:
        bits += 1
    # All hash arithmetic in uint64: numba would unify int64 with uint64 as float64.
    mask = np.uint64((1 << bits) - 1)
    one = np.uint64(1)
    keys = np.empty(1 << bits, dtype=np.int64)
    slots = np.full(1 << bits, -1, dtype=np.int64)  # (interleaving keys and slots measured slower)
    shift = np.uint64(64 - bits)
    golden = np.uint64(0x9E3779B97F4A7C15)
    for k in range(uniques.shape[0]):
        h = (np.uint64(uniques[k]) * golden) >> shift
        while slots[h] >= 0:
            h = (h + one) & mask
        keys[h] = uniques[k]
        slots[h] = k
    for i in range(ids.shape[0]):
        h = (np.uint64(ids[i]) * golden) >> shift
        while slots[h] < 0 or keys[h] != ids[i]:
            h = (h + one) & mask
        codes[i] = slots[h]


@_jit()
def masked_rows_sum(
    bits: Any, present: Any, sums: Any, start: int, stop: int, scratch_bits: Any, scratch_floats: Any, divisor: float
) -> None:
    """``sums[j] += value[i, j]`` where present, for columns ``start:stop``, microbatch by microbatch.

    ``bits`` is the values' bit pattern (a uint32/uint64 view of float32/float64)
    and ``present`` a uint8 view of the mask: ANDing the bits with 0 or ~0
    turns an absent value, even a NaN, into +0.0 without a branch, so the loop
    vectorises; adding +0.0 to a sum that started at +0.0 changes no bit.
    ``scratch_bits`` (4 x BLOCK) receives masked rows; ``scratch_floats`` (the
    same memory as floats) is what gets added. Four microbatches are added per
    visit of the float64 sums, in order ``(((s + a) + b) + c) + d``, which cuts
    the loads and stores of the sums fourfold and keeps every element's order.
    A non-zero ``divisor`` (M, for a one-shot mean) divides each block while
    it is still in cache, saving a pass over the result.
    """
    m = bits.shape[0]
    for lo in range(start, stop, BLOCK):
        n = min(stop, lo + BLOCK) - lo
        out = sums[lo : lo + n]
        i = 0
        while i < m:
            group = min(4, m - i)
            for r in range(group):
                row = bits[i + r, lo : lo + n]
                keep = present[i + r, lo : lo + n]
                masked = scratch_bits[r]
                for j in range(n):
                    masked[j] = row[j] & (np.uint64(0) - np.uint64(keep[j]))
            f0, f1, f2, f3 = scratch_floats[0], scratch_floats[1], scratch_floats[2], scratch_floats[3]
            if group == 4:
                for j in range(n):
                    out[j] = (((out[j] + f0[j]) + f1[j]) + f2[j]) + f3[j]
            else:
                for r in range(group):
                    fr = scratch_floats[r]
                    for j in range(n):
                        out[j] += fr[j]
            i += group
        if divisor != 0:
            for j in range(n):
                out[j] /= divisor


@_jit()
def rows_sum(values: Any, sums: Any, start: int, stop: int, divisor: float) -> None:
    """``sums[j] += values[i, j]`` for columns ``start:stop``, microbatch by microbatch; ``/ divisor`` if set."""
    for lo in range(start, stop, BLOCK):
        n = min(stop, lo + BLOCK) - lo
        out = sums[lo : lo + n]
        for i in range(values.shape[0]):
            row = values[i, lo : lo + n]
            for j in range(n):
                out[j] += row[j]
        if divisor != 0:
            for j in range(n):
                out[j] /= divisor


_POOL: list[ThreadPoolExecutor] = []


def pool() -> ThreadPoolExecutor:
    """One pool for the process: starting threads per call cost milliseconds on a busy machine."""
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor  # imported here: a one-shot command may not need it

        _POOL.append(ThreadPoolExecutor(4, thread_name_prefix="gradagg"))
    return _POOL[0]
