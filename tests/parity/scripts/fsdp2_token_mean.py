"""Right under FSDP2 for equal microbatch counts: fully_shard, sum reductions, one reduce-scatter per rank.

Gradients are DTensors sharded over the ranks; parity gathers them with full_tensor(). Only layouts
where every rank runs the same number of microbatches (8, 4,4): uneven counts under FSDP2 need the
recipe of issue 8 (unsharded parameters over the window), which this fixture does not attempt.
"""

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
import torch.distributed as dist
from _token_lm import build_model, full_batch_loss, microbatches, n_tokens, token_loss
from torch.distributed.fsdp import fully_shard

__all__ = ["build_model", "full_batch_loss", "microbatches", "prepare", "step"]


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    fully_shard(model, reshard_after_forward=False)
    model.set_gradient_divide_factor(1.0)  # a sum over ranks; the token divisor comes after
    return model


def step(model: torch.nn.Module, microbatches: list) -> None:
    tokens = torch.tensor(float(sum(n_tokens(mb) for mb in microbatches)), dtype=torch.float64)
    dist.all_reduce(tokens)
    for k, mb in enumerate(microbatches):
        model.set_requires_gradient_sync(k == len(microbatches) - 1)  # reduce-scatter in the last backward
        token_loss(model, mb).backward()
    for p in model.parameters():
        p.grad /= tokens  # a DTensor shard: each rank divides its own
