"""gradagg: exactly-once gradient aggregation.

Two contracts, each declared, checked and visible:

* :func:`owner_sum` — owner-only shard reduction: only a shard's owner
  contributes its gradient; replicas are held but never counted.
* :func:`microbatch_mean` — microbatch accumulation weighting: an absent
  parameter contributes zero and the divisor is the counted number of
  microbatches, never an activity counter.

See :mod:`gradagg.reference` for the vocabulary (shard, worker, owner, replica,
microbatch, absent, participation, divisor). Training loops use
:mod:`gradagg.torch` and :mod:`gradagg.integrations`; the file side (columnar
engines, Parquet/JSON/CSV, the ``owner-sum`` and ``mean`` commands) is
:mod:`gradagg.rows`, behind the ``rows`` extra. ``import gradagg`` imports no
heavy framework: NumPy, PyTorch and PyArrow are loaded only by the modules
that need them.
"""

from gradagg.errors import (
    CollectiveError,
    ContractError,
    FormatError,
    GradaggError,
    GradientShapeError,
    GradientTypeError,
    IdError,
    NonFiniteGradientError,
    NumberRangeError,
    OutputError,
    RowShapeError,
    UnorderableShardError,
    WindowError,
)
from gradagg.reference import microbatch_mean, owner_sum

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "ContractError",
    "FormatError",
    "GradaggError",
    "GradientShapeError",
    "GradientTypeError",
    "IdError",
    "NonFiniteGradientError",
    "NumberRangeError",
    "OutputError",
    "RowShapeError",
    "UnorderableShardError",
    "WindowError",
    "microbatch_mean",
    "owner_sum",
]

# Names that moved to gradagg.rows: asked for here, the error says where they are now.
_MOVED = ("owner_sum_columns", "microbatch_mean_columns")


def __getattr__(name: str) -> object:
    if name in _MOVED:
        raise AttributeError(f"gradagg.{name} is now gradagg.rows.{name} (the file side, behind the rows extra)")
    raise AttributeError(f"module 'gradagg' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The API only: the names in ``__all__`` and ``__version__`` (no imports, no submodules)."""
    return sorted([*__all__, "__version__"])
