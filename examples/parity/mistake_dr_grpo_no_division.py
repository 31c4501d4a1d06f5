"""Wrong: ``seq-mean-token-sum-norm`` (Dr. GRPO) summed and never divided (verl#3741).

The divisor, 16 sequences x NORM 12, is left out: every cell is 192x. Exit 1.
"""

import torch
from _modes_lm import build_model, full_batch_loss_of, microbatches, no_division_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]

MODE = "seq-mean-token-sum-norm"


def full_batch_loss(model: torch.nn.Module, microbatches: list) -> torch.Tensor:
    return full_batch_loss_of(MODE, model, microbatches)


def step(model: torch.nn.Module, microbatches: list) -> None:
    no_division_step(MODE, model, microbatches)
