"""Input checks for columnar input, on NumPy arrays (shared by the backends), and the one NaN locator.

Every check raises a :class:`~gradagg.errors.GradaggError` subclass whose
message names the column, the row (counted from the first row ever fed to an
accumulator, via ``offset``) and the values at fault.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gradagg.errors import (
    GradaggError,
    GradientShapeError,
    GradientTypeError,
    IdError,
    NonFiniteGradientError,
    RowShapeError,
    short_repr,
)

Array = NDArray[Any]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_EXACT = 2**53  # integers, and sums of integers, up to this magnitude are exact in float64
_USE_PYTHON = "use engine='python' (the reference), which sums Python integers exactly"


def sum_dtype(values: Array) -> np.dtype[Any]:
    """The one rule for what a sum is held in: int64 for integer values (exact), float64 for any other.

    >>> sum_dtype(np.zeros(1, dtype=np.int8)).name, sum_dtype(np.zeros(1, dtype=np.float32)).name
    ('int64', 'float64')
    """
    return np.dtype(np.int64) if values.dtype.kind in "iu" else np.dtype(np.float64)


def as_ids(name: str, x: Any, offset: int = 0) -> tuple[Array, str]:
    """Return ``(ids, kind)``: ``"int"`` for an integer array; ``"str"`` or ``"object"`` for ids held as Python keys.

    ``"str"``: a ``<U`` array as given, or an object array of the Python strings
    themselves (``<U`` drops trailing NULs: ``"a"`` and ``"a\\0"`` would be one
    id). ``"object"``: an object array of Python ints and strings, as the
    reference allows them, e.g. ints beyond int64 or a column mixing both (only
    the shards that are counted must be mutually orderable).
    """
    if is_dictionary_ids(x):  # indices into distinct ids (the Arrow adapter's string columns)
        if set(map(type, x.values.tolist())) <= {str}:
            return x, "str"
        x = x.tolist()
    a = x if isinstance(x, np.ndarray) else _object_array(x)
    if a.ndim != 1:
        raise RowShapeError(f"{name} must be one-dimensional (one id per row), got shape {a.shape}")
    kind = a.dtype.kind
    if kind == "U":
        return a, "str"
    if kind == "i":
        return a, "int"
    if kind == "u":
        if a.size and int(a.max()) > INT64_MAX:
            return _object_array(a.tolist()), "object"  # exact Python ints beyond int64
        return a.astype(np.int64), "int"
    if kind == "O":
        return _object_ids(name, a, offset)
    what = {"b": "bool", "f": "float", "S": "bytes (decode them to str)"}.get(kind, str(a.dtype))
    raise IdError(f"{name} must hold int or str ids, got a {what} column (dtype {a.dtype})")


def is_dictionary_ids(x: Any) -> bool:
    """Whether ``x`` is a dictionary-encoded id column: integer ``indices`` into an object array of ``values``."""
    return isinstance(getattr(x, "indices", None), np.ndarray) and isinstance(getattr(x, "values", None), np.ndarray)


def _object_array(x: Iterable[Any]) -> Array:
    """A 1-D object array of a Python sequence, without NumPy's silent int -> str coercion."""
    items = list(x)
    a = np.empty(len(items), dtype=object)
    a[:] = items
    return a


def _object_ids(name: str, a: Array, offset: int) -> tuple[Array, str]:
    values = a.tolist()
    types = set(map(type, values))
    if not values:
        return np.empty(0, dtype=np.int64), "int"
    if types <= {str}:
        return a, "str"
    if types <= {int}:
        if all(INT64_MIN <= v <= INT64_MAX for v in values):
            return np.array(values, dtype=np.int64), "int"
        return a, "object"
    for r, v in enumerate(values):
        if v is None:
            raise IdError(f"row {offset + r}: {name} is missing (None); every row needs a shard, worker and owner id")
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise IdError(
                f"row {offset + r}: {name} must be an int or a string, got {type(v).__name__} {short_repr(v)}"
            )
    # int and str subclasses become plain ints and strings, which is how the reference compares them.
    plain = _object_array(str(v) if isinstance(v, str) else int(v) for v in values)
    if all(isinstance(v, str) for v in values):
        return plain, "str"
    return _object_ids(name, plain, offset) if all(isinstance(v, int) for v in values) else (plain, "object")


def owner_rows(workers: Array, worker_kind: str, owners: Array, owner_kind: str) -> Array:
    """The boolean owner-row mask ``worker == owner``, compared as Python compares the ids.

    Two integer arrays compare as integers; anything else as Python objects
    (exact for strings with NULs, ints beyond int64, an int never equal to a str).

    >>> owner_rows(np.array(["w", "w\\0"], dtype=object), "str", np.array(["w", "w"], dtype=object), "str").tolist()
    [True, False]
    """
    fixed = isinstance(workers, np.ndarray) and workers.dtype.kind == owners.dtype.kind == "U"
    if worker_kind == owner_kind == "int" or fixed:  # (two <U arrays: neither can hold a trailing NUL)
        same: Array = np.equal(workers, owners)
        return same
    return np.asarray(workers.astype(object) == owners.astype(object), dtype=bool)


def as_gradients(x: Any, name: str = "gradients") -> Array:
    """Return an ``(N,)`` or ``(N, D)`` int64, float32 or float64 array (other dtypes widened)."""
    a = x if isinstance(x, np.ndarray) else numbers_array(list(x), name)
    if a.ndim not in (1, 2):
        raise GradientShapeError(f"{name} must have shape (N,) or (N, D), got shape {a.shape} (ndim {a.ndim})")
    return widen(a, name)


def widen(a: Array, name: str) -> Array:
    """Keep float32/float64/int64; widen other ints and floats; reject bool and non-numbers."""
    kind = a.dtype.kind
    if kind == "b":
        raise GradientTypeError(f"{name} are bool; True as a gradient is almost always a bug: cast to int or float")
    if kind == "f":
        return a if a.dtype in (np.float32, np.float64) else a.astype(np.float64)
    if kind == "i":
        return a if a.dtype == np.int64 else a.astype(np.int64)
    if kind == "u":
        if a.size and int(a.max()) > INT64_MAX:
            raise GradaggError(f"{name} hold values beyond int64 (max {int(a.max())}); {_USE_PYTHON}")
        return a.astype(np.int64)
    if kind == "O":
        return numbers_array(a.tolist(), name)
    raise GradientTypeError(f"{name} must be integers or floats, got dtype {a.dtype}")


def numbers_array(items: list[Any], name: str) -> Array:
    """Python numbers (or equal-length lists of them) as one int64 or float64 array, never silently rounded.

    All ints: int64 (beyond int64 is an error naming the row). Any float: float64,
    which is exact for the ints only while they sum to at most 2**53 in
    magnitude; beyond that the ints would be rounded, so it is an error.
    """
    items = [_checked_row(r, v, name) for r, v in enumerate(items)]
    values = [x for row in items for x in (row if isinstance(row, list) else [row])]
    ints = [v for v in values if isinstance(v, int)]
    if len(ints) == len(values):
        for k, v in enumerate(values):
            if not INT64_MIN <= v <= INT64_MAX:
                raise GradaggError(f"{name}: {v} (value {k}) is beyond int64; {_USE_PYTHON}")
        dtype: Any = np.int64
    else:
        if sum(map(abs, ints)) > _EXACT:
            raise GradaggError(
                f"{name} mix floats with integers summing to more than 2**53 in magnitude, which float64 would "
                f"round; pass an int64 or float64 array, or {_USE_PYTHON}"
            )
        dtype = np.float64
    try:
        return np.array(items, dtype=dtype) if items else np.empty(0, dtype=np.float64)
    except ValueError:
        raise GradientShapeError(f"{name}: vector gradients differ in length, or mix scalars and vectors") from None


def _checked_row(r: int, v: Any, name: str) -> Any:
    if _is_number(v):
        return _plain(v)
    if isinstance(v, (list, tuple)) and all(_is_number(e) for e in v):
        return [_plain(e) for e in v]
    raise GradientTypeError(f"row {r}: {name} must be numbers or lists of numbers, got {short_repr(v)}")


def _plain(v: Any) -> Any:
    """A NumPy scalar as the Python number it holds (np.int64 is not an int, np.float64 is a float)."""
    return v.item() if isinstance(v, np.generic) else v


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_))


def check_lengths(columns: dict[str, int]) -> None:
    """All columns must have one entry per row."""
    if len(set(columns.values())) > 1:
        listed = ", ".join(f"{name} has {n}" for name, n in columns.items())
        raise RowShapeError(f"columns differ in length: {listed} rows")


def first_nonfinite(values: Array, counted: Array | None = None) -> tuple[int, ...] | None:
    """The index of the first NaN or Inf among the counted values, in row-major order; None if there is none.

    The one NaN locator of gradagg's arrays. ``counted`` masks rows (shape
    ``values.shape[:1]``) or single values (``values.shape``); an uncounted
    NaN, a replica's or an absent value's, is never found.

    >>> first_nonfinite(np.array([[1.0, 2.0], [3.0, np.inf]]))
    (1, 1)
    >>> first_nonfinite(np.array([np.nan, 1.0]), counted=np.array([False, True])) is None
    True
    """
    if values.dtype.kind != "f" or values.size == 0:
        return None
    bad = ~np.isfinite(values)
    if counted is not None:
        bad &= counted.reshape(counted.shape + (1,) * (bad.ndim - counted.ndim))
    if not bad.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(bad.argmax()), bad.shape))


def nonfinite_error(where: str, value: Any) -> NonFiniteGradientError:
    """The error for a counted NaN or Inf: ``"<where> is nan; NaN and Inf are values, not absence"``."""
    return NonFiniteGradientError(f"{where} is {float(value)!r}; NaN and Inf are values, not absence")


def check_finite_values(values: Array, present: Array | None, offset: int, parameter_offset: int = 0) -> None:
    """Raise for the first present NaN/Inf of ``(M, P)`` microbatch values, in microbatch-major order."""
    found = first_nonfinite(values, present)
    if found is not None:
        i, j = found
        raise nonfinite_error(f"microbatch {offset + i}, parameter {parameter_offset + j}", values[i, j])


def check_like_first_microbatch(m: int, width: int, first_width: int, integers: bool, first_integers: bool,
                               found: str, before: str) -> None:
    """The one rule for every batch of microbatches after the first: as many values, and the same numeric kind.

    Args:
        m: the index of the batch's first microbatch.
        width, first_width: P of this batch and of microbatch 0.
        integers, first_integers: whether this batch's values and the sums so far are integers.
        found, before: the two types as the backend names them (e.g. ``float32``, ``float64``).
    """
    if width != first_width:
        raise RowShapeError(f"microbatch {m}: has {width} values, expected {first_width} (from microbatch 0)")
    if integers != first_integers:
        raise GradientTypeError(f"microbatch {m}: values are {found} here but {before} sums before; "
                                "feed one numeric kind (integers or floats)")


def check_int_headroom(gradients: Array, totals_absmax: int) -> None:
    """Refuse counted integer gradients whose totals could overflow int64 (a cheap, safe bound)."""
    if gradients.dtype.kind != "i" or gradients.size == 0:
        return
    magnitude = float(np.abs(gradients.astype(np.float64)).sum())  # float64: no wrap-around
    bound = magnitude * (1 + gradients.size * 2.0**-52) + totals_absmax  # the float sum's own error, covered
    if bound >= 2.0**63:
        raise GradaggError(
            f"integer totals could overflow int64 (counted |gradients| sum to about {magnitude:.3g}, "
            f"totals so far up to {totals_absmax}); {_USE_PYTHON}"
        )


def exact_means(sums: Array, m: int) -> Array:
    """``sums / m`` as float64, each as Python divides: int64 sums beyond 2**53 via Python's exact int / int.

    >>> exact_means(np.array([2**53 + 2]), 3).tolist() == [(2**53 + 2) / 3]
    True
    """
    means: Array = sums / m
    if sums.dtype.kind == "i":  # below 2**53 an int64 is exact in float64, and IEEE division rounds correctly
        flat, out = sums.reshape(-1), means.reshape(-1)
        for k in np.flatnonzero(np.abs(flat) > _EXACT).tolist():
            out[k] = int(flat[k]) / m
    return means


def as_values_and_mask(values: Any, present: Any) -> tuple[Array, Array | None]:
    """Validate microbatch ``values`` ``(M, P)`` and the optional boolean ``present`` mask."""
    v = values if isinstance(values, np.ndarray) else np.asarray(values)
    if v.ndim != 2:
        raise RowShapeError(f"values must have shape (M, P) (M microbatches of P parameters), got shape {v.shape}")
    v = widen(v, "values")
    if present is None:
        return v, None
    m = present if isinstance(present, np.ndarray) else np.asarray(present)
    if m.dtype != np.bool_:
        raise GradientTypeError(f"present must be a boolean mask (True = present), got dtype {m.dtype}")
    if m.shape != v.shape:
        raise RowShapeError(f"present has shape {m.shape}, values have shape {v.shape}; they must match")
    return v, m
