"""Right: the ``seq-mean-token-mean`` mode through the accumulator, with the mode's weight (see ``_modes_lm``).

`gradagg parity --sweep examples/parity/mode_seq_mean_token_mean.py` reports every cell exact:
1, 2 and 3 ranks, 1, 2 and 4 microbatches each, even and uneven (a rank with none included); exit 0.
"""

import torch
from _modes_lm import build_model, full_batch_loss_of, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]

MODE = "seq-mean-token-mean"


def full_batch_loss(model: torch.nn.Module, microbatches: list) -> torch.Tensor:
    return full_batch_loss_of(MODE, model, microbatches)


def step(model: torch.nn.Module, microbatches: list) -> None:
    right_step(MODE, model, microbatches)
