"""gradagg: exactly-once gradient aggregation.

Two contracts, each declared, checked and visible:

* :func:`owner_sum` — owner-only shard reduction: only a shard's owner
  contributes its gradient; replicas are held but never counted.
* :func:`microbatch_mean` — microbatch accumulation weighting: an absent
  parameter contributes zero and the divisor is the counted number of
  microbatches, never an activity counter.

See :mod:`gradagg.reference` for the vocabulary (shard, worker, owner, replica,
microbatch, absent, participation, divisor). ``import gradagg`` imports no
heavy framework: NumPy, PyTorch and PyArrow are loaded only by the modules that
need them (``gradagg.engine``, ``gradagg.backends.*``, ``gradagg.torch``).
"""

from __future__ import annotations

from typing import Any

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

# Columnar entry points live in gradagg.engine, which imports NumPy; resolve
# them lazily so that `import gradagg` stays free of heavy imports.
_LAZY = {"owner_sum_columns": "gradagg.engine", "microbatch_mean_columns": "gradagg.engine"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gradagg' has no attribute {name!r}")
