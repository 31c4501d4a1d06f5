"""gradagg's training integration over ``torch.distributed`` (import it explicitly: ``import gradagg.torch``).

* :class:`MicrobatchAccumulator`: exactly-once microbatch accumulation; ``.grad`` = sum over the
  microbatches of all ranks / D, D counted (M, or the total weight); plain modules, DDP, FSDP2, HSDP.
* :class:`Ownership` and :func:`owner_reduce`: declared owners, checked across ranks before data
  moves; per shard the sum of its owner's contributions only; one collective.
* :func:`grad_norm` and :func:`clip_grad_norm_`: the global norm with each parameter counted once;
  one scalar collective.
* :class:`PipelineAccumulator`: a ``torch.distributed.pipelining`` step made exact with a token divisor
  counted once on the last stage; ties across stages summed, and counted once in its norm.
* :func:`count_collectives`: count what the above send (tests, benchmarks).

Every function takes ``group=None``: the default process group when one is initialised, and a
plain process with no communication when none is.
"""

from __future__ import annotations

from gradagg.errors import TORCH_HINT

try:
    import torch as _torch  # noqa: F401  (only to say what to install when it is missing)
except ModuleNotFoundError as _missing:
    if _missing.name != "torch":
        raise
    raise ImportError(f"gradagg.torch needs PyTorch, which is not installed: {TORCH_HINT}") from None

from gradagg.torch.accumulate import MicrobatchAccumulator
from gradagg.torch.accumulate.ledger import Ledger
from gradagg.torch.collectives import CollectiveCount, count_collectives
from gradagg.torch.norm import clip_grad_norm_, grad_norm
from gradagg.torch.ownership import Ownership, ShardSpec
from gradagg.torch.pipeline import PipelineAccumulator, PipelineLedger
from gradagg.torch.reduce import owner_reduce

__all__ = [
    "CollectiveCount",
    "Ledger",
    "MicrobatchAccumulator",
    "Ownership",
    "PipelineAccumulator",
    "PipelineLedger",
    "ShardSpec",
    "clip_grad_norm_",
    "count_collectives",
    "grad_norm",
    "owner_reduce",
]
