"""Wrong: ``token-mean`` (DAPO) divided by the generation batch's token count (trl#5619).

The generation batch feeds two optimizer steps (``steps_per_generation`` = 2 x
``gradient_accumulation_steps``), so its count is twice the window's: every cell, one process
included, is 0.5x. Exit 1.
"""

import torch
from _modes_lm import build_model, full_batch_loss_of, generation_batch_count_step, microbatches

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]

MODE = "token-mean"


def full_batch_loss(model: torch.nn.Module, microbatches: list) -> torch.Tensor:
    return full_batch_loss_of(MODE, model, microbatches)


def step(model: torch.nn.Module, microbatches: list) -> None:
    generation_batch_count_step(MODE, model, microbatches)
