"""Unusable: build_model() draws fresh random weights on every call."""

import torch
from _tiny import full_batch_loss, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def build_model() -> torch.nn.Module:
    return torch.nn.Linear(3, 1).double()


step = right_step
