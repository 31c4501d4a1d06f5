"""Input checks for columnar input, on NumPy arrays (shared by the backends).

Every check raises a :class:`~gradagg.errors.GradaggError` subclass whose
message names the column, the row (counted from the first row ever fed to an
accumulator, via ``offset``) and the values at fault.
"""

from __future__ import annotations

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
)

Array = NDArray[Any]
_INT64_MAX = 2**63 - 1


def check_nonfinite_option(nonfinite: str) -> None:
    """Reject anything but the two documented ``nonfinite`` policies."""
    if nonfinite not in ("propagate", "raise"):
        raise GradaggError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")


def as_ids(name: str, x: Any, offset: int = 0) -> tuple[Array, str]:
    """Return ``(ids, kind)``: an int64/int32 or unicode array and ``"int"`` or ``"str"``."""
    a = x if isinstance(x, np.ndarray) else _object_array(x)
    if a.ndim != 1:
        raise RowShapeError(f"{name} must be one-dimensional (one id per row), got shape {a.shape}")
    kind = a.dtype.kind
    if kind == "U":
        return a, "str"
    if kind == "i":
        return a, "int"
    if kind == "u":
        if a.size and int(a.max()) > _INT64_MAX:
            row = int(a.argmax())
            raise IdError(f"row {offset + row}: {name} is {int(a[row])}, beyond int64")
        return a.astype(np.int64), "int"
    if kind == "O":
        return _object_ids(name, a, offset)
    what = {"b": "bool", "f": "float", "S": "bytes (decode them to str)"}.get(kind, str(a.dtype))
    raise IdError(f"{name} must hold int or str ids, got a {what} column (dtype {a.dtype})")


def _object_array(x: Any) -> Array:
    """A 1-D object array of a Python sequence, without NumPy's silent int -> str coercion."""
    items = list(x)
    a = np.empty(len(items), dtype=object)
    a[:] = items
    return a


def _object_ids(name: str, a: Array, offset: int) -> tuple[Array, str]:
    if not a.size:
        return np.empty(0, dtype=np.int64), "int"
    types = {type(v) for v in a.tolist()}
    if types <= {str}:
        return a.astype(str), "str"
    if types <= {int}:
        if any(v > _INT64_MAX or v < -_INT64_MAX - 1 for v in a.tolist()):
            raise IdError(f"{name} holds ids beyond int64")
        return a.astype(np.int64), "int"
    values = a.tolist()
    for r, v in enumerate(values):
        if v is None:
            raise IdError(f"row {offset + r}: {name} is missing (None); every row needs a shard, worker and owner id")
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise IdError(f"row {offset + r}: {name} must be an int or a string, got {type(v).__name__} {v!r}")
    i = next(r for r, v in enumerate(values) if isinstance(v, int))
    s = next(r for r, v in enumerate(values) if isinstance(v, str))
    raise IdError(
        f"{name} mixes int and str ids ({values[i]!r} at row {offset + i}, {values[s]!r} at row {offset + s}); "
        "use one id type per column"
    )


def as_gradients(x: Any, name: str = "gradients") -> Array:
    """Return an ``(N,)`` or ``(N, D)`` int64, float32 or float64 array (other dtypes widened)."""
    a = x if isinstance(x, np.ndarray) else _numeric_array(x, name)
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
        if a.size and int(a.max()) > _INT64_MAX:
            raise GradaggError(f"{name} hold values beyond int64 (max {int(a.max())}); use engine='python'")
        return a.astype(np.int64)
    if kind == "O":
        return widen(_numeric_array(a.tolist(), name), name)
    raise GradientTypeError(f"{name} must be integers or floats, got dtype {a.dtype}")


def _numeric_array(x: Any, name: str) -> Array:
    items = list(x)
    for r, v in enumerate(items):
        bad = isinstance(v, bool) or not isinstance(v, (int, float, list, tuple, np.number))
        if bad or (isinstance(v, (list, tuple)) and any(isinstance(e, bool) or not _is_number(e) for e in v)):
            raise GradientTypeError(f"row {r}: {name} must be numbers or lists of numbers, got {v!r}")
    try:
        return np.asarray(items) if items else np.empty(0, dtype=np.float64)
    except ValueError:
        raise GradientShapeError(f"{name}: vector gradients differ in length") from None


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_))


def check_lengths(columns: dict[str, int]) -> None:
    """All columns must have one entry per row."""
    if len(set(columns.values())) > 1:
        listed = ", ".join(f"{name} has {n}" for name, n in columns.items())
        raise RowShapeError(f"columns differ in length: {listed} rows")


def check_same_id_kind(worker_kind: str, owner_kind: str) -> None:
    """A worker id can only equal an owner id of the same type."""
    if worker_kind != owner_kind:
        raise IdError(
            f"worker_ids are {worker_kind} but owner_ids are {owner_kind}: no row could ever be counted; "
            "use one id type for both"
        )


def first_nonfinite(owned: Array, gradients: Array, shards: Array, offset: int) -> None:
    """Raise NonFiniteGradientError for the first counted row holding NaN or Inf."""
    if gradients.dtype.kind != "f":
        return
    bad = ~np.isfinite(gradients)
    rows = bad.any(axis=1) if bad.ndim == 2 else bad
    rows &= owned
    if not rows.any():
        return
    r = int(rows.argmax())
    at, value = ("", gradients[r]) if bad.ndim == 1 else (f" element {int(bad[r].argmax())}", gradients[r, bad[r]][0])
    raise NonFiniteGradientError(
        f"row {offset + r}: gradient of shard {shards[r].item()!r}{at} is {float(value)!r}; "
        "NaN and Inf are values, not absence"
    )


def check_int_headroom(gradients: Array, owned_count: int, totals_absmax: int) -> None:
    """Refuse integer input whose totals could overflow int64 (a conservative, cheap bound)."""
    if gradients.dtype.kind != "i" or gradients.size == 0:
        return
    biggest = max(abs(int(gradients.max())), abs(int(gradients.min())))
    if biggest * owned_count + totals_absmax > _INT64_MAX:
        raise GradaggError(
            f"integer totals could overflow int64 (|gradient| up to {biggest} over {owned_count} counted rows); "
            "use engine='python' for unbounded integers"
        )


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


def check_finite_values(v: Array, m: Array | None, offset: int) -> None:
    """Raise NonFiniteGradientError at the first present NaN/Inf, in microbatch-major order."""
    if v.dtype.kind != "f":
        return
    bad = ~np.isfinite(v)
    if m is not None:
        bad &= m
    if bad.any():
        i, j = np.unravel_index(int(bad.argmax()), bad.shape)
        raise NonFiniteGradientError(
            f"microbatch {offset + int(i)}, parameter {int(j)} is {float(v[i, j])!r}; "
            "NaN and Inf are values, not absence"
        )


def check_finite_item(value: Array, where: str) -> None:
    """Raise NonFiniteGradientError if a (maybe multi-dimensional) value holds NaN or Inf."""
    if value.dtype.kind != "f":
        return
    bad = ~np.isfinite(value)
    if bad.any():
        k = int(bad.reshape(-1).argmax())
        at = f" element {k}" if value.ndim else ""
        raise NonFiniteGradientError(
            f"{where}{at} is {float(value.reshape(-1)[k])!r}; NaN and Inf are values, not absence"
        )
