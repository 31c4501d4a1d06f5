"""Wrong: ``seq-mean-token-mean`` (GRPO) as a mean of microbatch means (trl#3021).

Each microbatch's mean over its sequences, averaged over the window's microbatches: exact when every
microbatch holds as many sequences, so 1 and 2 ranks with 1, 2 or 4 microbatches each pass it (16 rows in
2, 4 or 8 microbatches); 3 ranks split the 16 rows into 3, 6 or 12 unequal microbatches, and the sweep
reports no single factor there (1.02x to 1.29x per parameter). Exit 1.
"""

import torch
from _modes_lm import build_model, full_batch_loss_of, mean_of_microbatch_means_step, microbatches

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]

MODE = "seq-mean-token-mean"


def full_batch_loss(model: torch.nn.Module, microbatches: list) -> torch.Tensor:
    return full_batch_loss_of(MODE, model, microbatches)


def step(model: torch.nn.Module, microbatches: list) -> None:
    mean_of_microbatch_means_step(MODE, model, microbatches)
