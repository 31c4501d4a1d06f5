"""Right, autocast_bf16.py's step, but the full batch in float32 (no autocast): the step computes in bf16."""

import _autocast
import torch
from _autocast import build_model
from _token_lm import microbatches
from autocast_bf16 import DTYPE, weighted_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def full_batch_loss(model: torch.nn.Module, window: list) -> torch.Tensor:
    return _autocast.full_batch_loss(model, torch.float32, window)  # no autocast: float32


def step(model: torch.nn.Module, window: list) -> None:
    weighted_step(model, window, DTYPE)
