"""Rank 1's step spins in pure Python forever (no collective, no exit) while rank 0 waits for it."""

import time

import torch.distributed as dist
from _tiny import build_model, full_batch_loss, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model, microbatches) -> None:
    while dist.get_rank() == 1:
        time.sleep(0.01)
    right_step(model, microbatches)
