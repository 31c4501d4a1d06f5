"""The microbatch mean of the NumPy backend (exported by :mod:`gradagg.rows.backends.numpy`).

One sum per parameter, microbatch by microbatch, from +0.0 (the reference's
``0`` start), divided by M, the microbatches counted; an absent value adds
nothing and still counts in M. Float values are summed in float64 (NumPy's
``add(..., where=)`` in blocks; or, given ``kernels``, the ``numba`` engine's
loops: masked bits, four rows per visit, the division in cache), integer
values in int64, exactly, then divided as Python divides integers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from gradagg.errors import GradientShapeError, RowShapeError
from gradagg.options import check_nonfinite
from gradagg.rows.backends import _checks

Array = NDArray[Any]

# Parameters per block in the NumPy path: keeps the float64 sums in L2.
_MEAN_BLOCK = 1 << 16
# NaN and Inf are values (inf + -inf is NaN, 1e308 + 1e308 is inf, as in Python): no NumPy warnings for them.
_IEEE = np.errstate(over="ignore", invalid="ignore")


@_IEEE
def microbatch_mean(
    values: Any, present: Any = None, *, nonfinite: str = "propagate", parameter_offset: int = 0,
    kernels: Any = None,
) -> Any:
    """Microbatch mean on NumPy input (see :func:`gradagg.rows.engine.microbatch_mean_columns`).

    Args:
        values: ``(M, P)`` array, or a list of M lists of P arrays/numbers/``None``.
        present: ``(M, P)`` boolean mask for array input; ``None`` = all present.
        nonfinite: ``"propagate"`` or ``"raise"``.
        parameter_offset: the number of the first parameter, in messages (a batch of a longer input).
        kernels: :mod:`gradagg.rows.backends._kernels` for the fused loops (the ``numba`` engine), or None.

    Returns:
        ``(P,)`` float64 means (divisor M), or a list of P float64 arrays for list input.

    Raises:
        GradaggError: see :func:`gradagg.rows.engine.microbatch_mean_columns`.

    >>> microbatch_mean([[2.0, None], [4.0, 6.0]])
    [array(3.), array(3.)]
    """
    check_nonfinite(nonfinite)
    if isinstance(values, (list, tuple)):
        return _mean_of_lists(values, nonfinite)
    v, mask = _checks.as_values_and_mask(values, present)
    if nonfinite == "raise":
        _checks.check_finite_values(v, mask, 0, parameter_offset)
    if v.shape[0] == 0:
        return np.empty(0, dtype=np.float64)  # no microbatch: the reference's []
    if v.dtype.kind == "i":  # exact integer sums, then the reference's correctly rounded division
        acc = ColumnarMean(nonfinite=nonfinite)
        acc.update(v, mask)
        return acc.result()
    means = np.zeros(v.shape[1], dtype=np.float64)
    _add_rows(means, v, mask, kernels, divisor=v.shape[0])  # the divisor is M, counted, nothing else
    return means


class ColumnarMean:
    """Microbatch mean fed k microbatches at a time: one sum per parameter, divided by M at the end.

    Float values are summed in float64 from +0.0 (the reference's ``0`` start);
    integer values in int64, exactly (an overflow risk is an error), and each
    sum is divided as Python divides integers, correctly rounded.

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.
        kernels: :mod:`gradagg.rows.backends._kernels` for the fused loops (the ``numba`` engine), or None.

    >>> acc = ColumnarMean()
    >>> acc.update(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[True, False], [True, True]]))
    >>> acc.result().tolist()
    [2.0, 2.0]
    """

    def __init__(self, *, nonfinite: str = "propagate", kernels: Any = None) -> None:
        self._nonfinite = check_nonfinite(nonfinite)
        self._kernels = kernels
        self._sums: Array | None = None
        self._m = 0  # the divisor: microbatches counted, nothing else

    @_IEEE
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
        kind = _checks.sum_dtype(v)
        if self._sums is None:
            self._sums = np.zeros(v.shape[1], dtype=kind)  # +0.0 for floats, as the reference's int 0 start
        else:
            _checks.check_like_first_microbatch(self._m, v.shape[1], len(self._sums), kind == np.int64,
                                                self._sums.dtype == np.int64, v.dtype.name, self._sums.dtype.name)
        if kind == np.int64:
            _checks.check_int_headroom(v if mask is None else v[mask], int(np.abs(self._sums).max(initial=0)))
        _add_rows(self._sums, v, mask, self._kernels)
        self._m += v.shape[0]

    @_IEEE
    def result(self) -> Array:
        """Return the ``(P,)`` float64 means: sums divided by the M microbatches fed.

        Returns:
            The means; an empty array when no microbatch was fed (as the reference).
        """
        if self._sums is None or self._m == 0:
            return np.empty(0, dtype=np.float64)
        return _checks.exact_means(self._sums, self._m)


def _add_rows(sums: Array, values: Array, present: Array | None, kernels: Any, divisor: int = 0) -> None:
    """``sums += values`` where present, microbatch by microbatch (each element in microbatch order).

    A non-zero ``divisor`` then divides the sums in place (the one-shot mean).
    """
    k = kernels
    if k is not None and values.size and sums.dtype.kind == "f" and (present is None or values.dtype.kind == "f"):
        ranges = k.column_ranges(values.shape[1], values.size)
        if len(ranges) == 1:
            _kernel_rows(k, sums, values, present, divisor, *ranges[0])
        else:
            list(k.pool().map(lambda r: _kernel_rows(k, sums, values, present, divisor, *r), ranges))
        return
    # Blocks keep the float64 sums in cache; `where=` adds without a masked temporary.
    for start in range(0, values.shape[1], _MEAN_BLOCK):
        block = slice(start, start + _MEAN_BLOCK)
        for i in range(values.shape[0]):
            where = True if present is None else present[i, block]
            np.add(sums[block], values[i, block], out=sums[block], where=where)
    if divisor:
        sums /= divisor


def _kernel_rows(
    k: Any, sums: Array, values: Array, present: Array | None, divisor: int, start: int, stop: int
) -> None:
    if present is None:
        k.rows_sum(values, sums, start, stop, float(divisor))
        return
    bits = np.dtype(f"u{values.dtype.itemsize}")
    scratch = np.empty((4, k.BLOCK), dtype=values.dtype)
    masks = (present.view(np.uint8), scratch.view(bits), scratch)
    k.masked_rows_sum(values.view(bits), masks[0], sums, start, stop, masks[1], masks[2], float(divisor))


def _mean_of_lists(rows: Any, nonfinite: str) -> list[Array]:
    """The list-of-lists form: per parameter, the sum of its present arrays over M.

    Summed as the reference sums Python numbers: in int64 while every value so
    far was an integer array, in float64 from the first float one on.
    """
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
            found = _checks.first_nonfinite(value.reshape(-1)) if nonfinite == "raise" else None
            if found is not None:
                at = f" element {found[0]}" if value.ndim else ""
                raise _checks.nonfinite_error(f"microbatch {i}, parameter {j}{at}", value.reshape(-1)[found])
            if total is None:
                total, first = np.zeros(value.shape, dtype=_checks.sum_dtype(value)), i
            elif value.shape != total.shape:
                raise GradientShapeError(
                    f"microbatch {i}, parameter {j}: shape {value.shape}, "
                    f"expected {total.shape} (from microbatch {first})"
                )
            total = _add_item(total, value, f"microbatch {i}, parameter {j}")
        out.append(np.zeros((), dtype=np.float64) if total is None else np.asarray(_checks.exact_means(total, m)))
    return out


def _add_item(total: Array, value: Array, where: str) -> Array:
    if total.dtype.kind == "i" and value.dtype.kind == "i":
        _checks.check_int_headroom(value, int(np.abs(total).max(initial=0)))
        return total + value
    return total.astype(np.float64) + value  # int64 -> float64 rounds as Python's int + float does
