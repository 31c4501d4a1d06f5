"""Rank 0 returns from its step without joining the all-reduces, leaving rank 1 stuck in a collective."""

import torch.distributed as dist
from _tiny import build_model, full_batch_loss, microbatches, right_step, sum_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model, microbatches) -> None:
    if dist.get_rank() == 0:
        for x in microbatches:
            sum_loss(model, x).backward()
        return
    right_step(model, microbatches)
