"""Right, autocast_bf16.py's step under ``torch.autocast("cpu", dtype=torch.float16)`` (CPU autocast runs fp16)."""

import _autocast
import torch
from _autocast import build_model
from _token_lm import microbatches
from autocast_bf16 import weighted_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]
DTYPE = torch.float16


def full_batch_loss(model: torch.nn.Module, window: list) -> torch.Tensor:
    return _autocast.full_batch_loss(model, DTYPE, window)


def step(model: torch.nn.Module, window: list) -> None:
    weighted_step(model, window, DTYPE)
