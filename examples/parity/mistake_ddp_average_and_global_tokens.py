"""Wrong: the global token count as the divisor, and DistributedDataParallel's average on top.

DDP divides the summed gradients by the world size; dividing the loss by the global token count as
well leaves the gradients 1/W of the truth (the bug that `loss *= num_processes` later compensated in
transformers). Right in one process: `gradagg parity examples/parity/mistake_ddp_average_and_global_tokens.py`
passes 8, fails 4,4 and 1,7 with "grads are 0.5x the truth on every parameter"; exit 1.
It also needs every rank to run at least one microbatch: DDP reduces inside the backward, so on layout
0,8 rank 0 returns without joining the reduction and rank 1 fails waiting for it.
"""

import contextlib

import torch
import torch.distributed as dist
from _token_lm import build_model, full_batch_loss, microbatches, n_tokens, token_loss
from torch.nn.parallel import DistributedDataParallel

__all__ = ["build_model", "full_batch_loss", "microbatches", "prepare", "step"]


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    return DistributedDataParallel(model)


def step(model: DistributedDataParallel, microbatches: list) -> None:
    tokens = torch.tensor(float(sum(n_tokens(mb) for mb in microbatches)), dtype=torch.float64)
    dist.all_reduce(tokens)  # the right divisor...
    for k, mb in enumerate(microbatches):
        last = k == len(microbatches) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # DDP reduces in the last backward only
            (token_loss(model, mb) / tokens).backward()  # ...and DDP's average over the ranks on top
