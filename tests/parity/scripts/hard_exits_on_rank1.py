"""Rank 1's process ends with os._exit(7) in the middle of its step: no result, no exception."""

import os

import torch.distributed as dist
from _tiny import build_model, full_batch_loss, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model, microbatches) -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    right_step(model, microbatches)
