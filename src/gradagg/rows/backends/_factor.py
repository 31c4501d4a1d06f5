"""Sorted factorisation of shard ids: the distinct ids in order, and each row's index into them.

Integers in a small range are marked in a table and counted (no sort);
other integers are argsorted once. Strings are never compared as strings:
NumPy sorts ``<U`` arrays with a generic character-by-character compare
(slow for ``np.unique`` on many ids). Instead each id's code points
become a few unsigned 64-bit keys, column by column in mixed radix (each
character position contributes just the range of code points seen there,
and positions equal in every id contribute nothing), and the keys are
factorised as integers. Packed keys compare exactly as Python compares the
strings: code point by code point, a prefix first (NumPy pads ``<U`` with
NUL and cannot hold a trailing NUL, so padding never ties two different ids).
Ids like ``"shard-0001234"`` pack into one key of range 10^7, small enough
for the table path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

Array = NDArray[Any]
_KEY_LIMIT = 1 << 63  # the product of position ranges that still fits one uint64 key


def factorize(ids: Array, lookup: Callable[[Array, Array, Array], None] | None = None) -> tuple[Array, Array]:
    """Return ``(uniques, inverse)``: the sorted distinct ids and each id's index into them.

    >>> u, inv = factorize(np.array(["b", "a", "b", "ab"]))
    >>> u.tolist(), inv.tolist()
    (['a', 'ab', 'b'], [2, 0, 2, 1])
    >>> [x.tolist() for x in factorize(np.array([10**12, 5, 5]))]
    [[5, 1000000000000], [1, 0, 0]]

    ``lookup(uniques, ids, codes)``, when given (the ``numba`` engine's compiled
    hash lookup), replaces the argsort of wide-range integer ids by ``np.sort``
    plus one lookup per id.
    """
    if not len(ids):
        return ids, np.zeros(0, dtype=np.int64)
    if ids.dtype.kind != "U":
        if lookup is not None and not _small_range(ids):
            ordered = np.sort(ids)  # a SIMD sort of values, much faster than an argsort of int64
            distinct = ordered[_starts(ordered)]
            codes = np.empty(len(ids), dtype=np.int64)
            lookup(distinct, ids, codes)
            return distinct, codes
        uniques, inverse = _factorize_keys([ids])
        return uniques[0], inverse
    width = ids.dtype.itemsize // 4
    if width == 0:
        return ids[:1], np.zeros(len(ids), dtype=np.int64)
    keys = _packed_keys(np.ascontiguousarray(ids).view(np.uint32).reshape(len(ids), width))
    first, inverse = _first_and_inverse(keys)
    return ids[first], inverse


def _factorize_keys(keys: list[Array]) -> tuple[list[Array], Array]:
    first, inverse = _first_and_inverse(keys)
    return [k[first] for k in keys], inverse


def _first_and_inverse(keys: list[Array]) -> tuple[Array, Array]:
    """Row numbers of one row per distinct key tuple (in sorted order), and each row's rank."""
    n = len(keys[0])
    if len(keys) == 1 and _small_range(keys[0]):
        lo, hi = int(keys[0].min()), int(keys[0].max())
        return _by_table(keys[0] - keys[0].dtype.type(lo), hi - lo + 1)
    order = np.lexsort(keys[::-1]) if len(keys) > 1 else np.argsort(keys[0], kind="stable")
    starts = np.zeros(n, dtype=bool)
    for key in keys:
        starts |= _starts(key[order])
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.cumsum(starts) - 1
    return order[starts], inverse


def _small_range(ids: Array) -> bool:
    """Ids whose range is small next to their count (or absolutely) are factorised by a table, not a sort."""
    return int(ids.max()) - int(ids.min()) < max(4 * len(ids), 1 << 16)


def _starts(ordered: Array) -> Array:
    """True where a sorted array starts a new value."""
    starts = np.empty(len(ordered), dtype=bool)
    starts[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    return starts


def _by_table(offsets: Array, span: int) -> tuple[Array, Array]:
    """Factorise ids already shifted into ``0 .. span - 1``: mark, count, look up; O(n + span)."""
    row_of = np.full(span, -1, dtype=np.int64)
    row_of[offsets] = np.arange(len(offsets))  # any row with the id will do as its representative
    mark = row_of >= 0
    return row_of[mark], (np.cumsum(mark) - 1)[offsets]


def _packed_keys(codepoints: Array) -> list[Array]:
    """Pack each row of code points into uint64 keys, most significant position first, in mixed radix."""
    low = codepoints.min(axis=0)
    radix = codepoints.max(axis=0).astype(np.int64) - low + 1
    keys: list[Array] = []
    key: Array | None = None
    room = 0
    for t in np.flatnonzero(radix > 1):
        base = int(radix[t])
        if key is None or room * base > _KEY_LIMIT:
            key = np.zeros(codepoints.shape[0], dtype=np.uint64)
            keys.append(key)
            room = 1
        key *= np.uint64(base)
        key += codepoints[:, t] - low[t]
        room *= base
    return keys or [np.zeros(codepoints.shape[0], dtype=np.uint64)]
