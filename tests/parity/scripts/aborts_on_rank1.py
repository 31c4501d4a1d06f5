"""Rank 1's process aborts (SIGABRT, as gloo's C++ checks do on a collective mismatch) while rank 0 waits."""

import os

import torch.distributed as dist
from _tiny import build_model, full_batch_loss, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model, microbatches) -> None:
    if dist.get_rank() == 1:
        os.abort()
    right_step(model, microbatches)
