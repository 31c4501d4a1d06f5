"""Ids held as Python keys (strings, or ints a fixed-width array cannot hold) as integer codes (for the fast backends).

A NumPy ``<U`` array cannot tell ``"a"`` from ``"a\\0"`` (it pads with NUL),
and its width is that of the longest id for every row. So string ids are never
turned into ``<U``: each distinct string gets a code, 0, 1, 2, ... in order of
first appearance (a dict lookup per row, or per distinct id of a ``<U`` array
the caller already holds), the backends add rows into tables indexed by code,
and :meth:`Interner.order` sorts the codes by their strings with Python's own
comparison, once, at the end. Memory grows with the distinct ids, not the rows.
The same holds for Python ints beyond int64 and for a column that mixes ints
and strings (the reference allows that as long as the counted shards can be
ordered; :meth:`Interner.order` raises when they cannot).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from gradagg.errors import IdError, UnorderableShardError, short_repr
from gradagg.rows.backends import _checks, _factor

Array = NDArray[Any]


class Interner:
    """Codes for ids held as Python keys (str or int), numbered in order of first appearance.

    >>> names = Interner()
    >>> names.codes(np.array(["b", "a\\0", "b"], dtype=object)).tolist(), names.codes(np.array(["a"])).tolist()
    ([0, 1, 0], [2])
    >>> names.keys(names.order(np.array([0, 1, 2])))
    ['a', 'a\\x00', 'b']
    """

    def __init__(self) -> None:
        self._index: dict[Any, int] = {}
        self._keys: list[Any] = []

    def codes(self, ids: Any) -> Array:
        """int64 codes of a ``<U`` array, an object array of ids, or dictionary ids (``indices``, ``values``)."""
        if _checks.is_dictionary_ids(ids):  # each distinct id once, then the indices mapped in NumPy
            codes: Array = self._codes_of(ids.values.tolist()).take(ids.indices)
            return codes
        if ids.dtype.kind == "U":  # distinct ids first, without a Python call per row
            uniques, inverse = _factor.factorize(ids)
            return self._codes_of(uniques.tolist())[inverse]
        return self._codes_of(ids.tolist())

    def _codes_of(self, keys: list[Any]) -> Array:
        index = self._index
        new = [k for k in dict.fromkeys(keys) if k not in index]  # dict.fromkeys: distinct, in order, in C
        index.update(zip(new, range(len(self._keys), len(self._keys) + len(new))))
        self._keys.extend(new)
        return np.fromiter(map(index.__getitem__, keys), np.int64, len(keys))

    def order(self, codes: Array) -> Array:
        """Positions that sort ``codes`` by their ids (strings code point by code point, a prefix first).

        Raises:
            UnorderableShardError: an int and a str among them, both named.
        """
        keys = self.keys(codes)
        try:
            return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
        except TypeError:
            a = next(k for k in keys if isinstance(k, int))
            b = next(k for k in keys if isinstance(k, str))
            raise UnorderableShardError(
                f"shard ids {short_repr(a)} (int) and {short_repr(b)} (str) both have owner rows and cannot be "
                "ordered against each other; use one id type for all shards"
            ) from None

    def keys(self, codes: Array) -> list[Any]:
        """The ids of ``codes``."""
        keys = self._keys
        return [keys[c] for c in codes.tolist()]

    def key(self, code: int) -> Any:
        """The id of one code."""
        return self._keys[code]


def object_array(strings: list[Any]) -> Array:
    """A 1-D object array of ``strings`` (or ints; never ``<U``, which would drop trailing NULs).

    >>> object_array(["a\\0"]).tolist()
    ['a\\x00']
    """
    a = np.empty(len(strings), dtype=object)
    a[:] = strings
    return a


def as_fixed(ids: Any, offset: int) -> Array:
    """String ids as a ``<U`` array, for an accumulator fed ``<U`` arrays before; refused where ``<U`` would lose one.

    Raises:
        IdError: an id ending in NUL, which ``<U`` would drop (feed object arrays from the first batch on).
    """
    values = ids.values.tolist() if _checks.is_dictionary_ids(ids) else ids.tolist()
    for k, v in enumerate(values):
        if v.endswith("\x00"):
            where = "a shard id" if _checks.is_dictionary_ids(ids) else f"row {offset + k}: the shard id"
            raise IdError(
                f"{where} {short_repr(v)} ends in NUL, which the <U shard ids fed before cannot hold; "
                "feed object arrays of str from the first batch on"
            )
    fixed = np.array(values, dtype=str) if values else np.empty(0, dtype="<U1")
    return fixed.take(ids.indices) if _checks.is_dictionary_ids(ids) else fixed
