"""A right FSDP2 step, except that rank 0 then drops its shard of the embedding's gradient (``.grad = None``).

Rank 1 still holds its DTensor shard: the gradient of '0.weight' exists on one rank and not on the other.
"""

import _examples  # noqa: F401  (examples/parity on sys.path)
import fsdp2_token_mean_gradagg as right
import torch
import torch.distributed as dist
from _token_lm import build_model, full_batch_loss, microbatches

__all__ = ["build_model", "full_batch_loss", "microbatches", "prepare", "step"]

prepare = right.prepare


def step(model: torch.nn.Module, microbatches: list) -> None:
    right.step(model, microbatches)
    if dist.get_rank() == 0:
        model[0].weight.grad = None
