"""The NumPy backend with fused numba kernels: ``engine="numba"``, chosen by ``"auto"`` where numba is installed.

The same tables, checks and summation order as :mod:`gradagg.rows.backends.numpy`
(float totals bit-identical to the reference), with the adds done by the
compiled loops of :mod:`gradagg.rows.backends._kernels`, which this module hands to
the NumPy backend's accumulators as their ``kernels``. Importing it imports
numba (an ImportError without it: :mod:`gradagg.rows.engine` turns that into a
one-line error naming the ``jit`` extra's install); ``engine="numpy"``
never does.
"""

from __future__ import annotations

from typing import Any

from gradagg.rows.backends import _kernels, _mean
from gradagg.rows.backends import numpy as _numpy


def owner_sum(
    shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any, *, nonfinite: str = "propagate"
) -> tuple[Any, Any]:
    """:func:`gradagg.rows.backends.numpy.owner_sum` with the kernels.

    >>> import numpy as np
    >>> s, t = owner_sum(np.array([3, 3, 1]), np.array([0, 1, 2]), np.array([0, 0, 2]), np.array([1.0, 9.0, 2.0]))
    >>> s.tolist(), t.tolist()
    ([1, 3], [2.0, 1.0])
    """
    return _numpy.owner_sum(shard_ids, worker_ids, owner_ids, gradients, nonfinite=nonfinite, kernels=_kernels)


def microbatch_mean(
    values: Any, present: Any = None, *, nonfinite: str = "propagate", parameter_offset: int = 0
) -> Any:
    """:func:`gradagg.rows.backends.numpy.microbatch_mean` with the kernels.

    >>> import numpy as np
    >>> microbatch_mean(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[True, False], [True, True]])).tolist()
    [2.0, 2.0]
    """
    return _mean.microbatch_mean(
        values, present, nonfinite=nonfinite, parameter_offset=parameter_offset, kernels=_kernels
    )


class ColumnarOwnerSum(_numpy.ColumnarOwnerSum):
    """:class:`gradagg.rows.backends.numpy.ColumnarOwnerSum` with the kernels."""

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        super().__init__(nonfinite=nonfinite, kernels=_kernels)


class ColumnarMean(_mean.ColumnarMean):
    """:class:`gradagg.rows.backends.numpy.ColumnarMean` with the kernels."""

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        super().__init__(nonfinite=nonfinite, kernels=_kernels)


__all__ = ["ColumnarMean", "ColumnarOwnerSum", "microbatch_mean", "owner_sum"]
