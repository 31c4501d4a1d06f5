"""Unusable: build_model() is the same on every call of one process but differs between processes."""

import os

import torch
from _tiny import full_batch_loss, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def build_model() -> torch.nn.Module:
    torch.manual_seed(os.getpid())
    return torch.nn.Linear(3, 1).double()


step = right_step
