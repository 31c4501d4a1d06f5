"""Wrong, autocast_bf16.py with each microbatch's MEAN loss given ``weight=n`` (divided twice): still caught."""

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
from _token_lm import microbatches
from autocast_bf16 import DTYPE, build_model, full_batch_loss, weighted_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, window: list) -> None:
    weighted_step(model, window, DTYPE, reduction="mean")
