"""The file side: both contracts on columns, rows and files, and the ``owner-sum`` / ``mean`` commands.

Installed with the ``rows`` extra (NumPy, pyarrow, orjson): ``pip install -e '.[rows]'`` in a clone of
gradagg (it is not on PyPI). Training code never needs it (:mod:`gradagg.torch`).

* :mod:`gradagg.rows.engine`: :func:`owner_sum_columns`, :func:`microbatch_mean_columns`, their
  ``_rows`` and ``_batches`` forms, and :class:`ColumnarOwnerSum` / :class:`ColumnarMean` fed batch by
  batch; the one place that chooses a backend (``engine=``) and converts between frameworks;
* :mod:`gradagg.rows.backends`: one module per array framework (``python``, ``numpy``, ``numba``,
  ``torch_tensors``), all behind one Protocol;
* :mod:`gradagg.rows.formats`: JSON, JSON Lines, CSV and Parquet in, results out, atomically;
* :mod:`gradagg.rows.commands`: ``gradagg owner-sum`` and ``gradagg mean`` (parsed by :mod:`gradagg.cli`).

The contracts themselves, and their pure-Python reference, are :mod:`gradagg.reference`; the checks
are :mod:`gradagg.verify`. Importing this package imports neither NumPy nor torch nor pyarrow.
"""

from gradagg.rows.engine import (
    ENGINES,
    ColumnarMean,
    ColumnarOwnerSum,
    available_engines,
    microbatch_mean_batches,
    microbatch_mean_columns,
    microbatch_mean_rows,
    owner_sum_batches,
    owner_sum_columns,
    owner_sum_rows,
    python_values,
)

__all__ = [
    "ENGINES",
    "ColumnarMean",
    "ColumnarOwnerSum",
    "available_engines",
    "microbatch_mean_batches",
    "microbatch_mean_columns",
    "microbatch_mean_rows",
    "owner_sum_batches",
    "owner_sum_columns",
    "owner_sum_rows",
    "python_values",
]
