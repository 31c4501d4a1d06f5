"""Wrong: the token sums backpropagated and all-reduced, and never divided.

The gradients are the truth times the window's 95 tokens on every parameter, and the summary says so:
`gradagg parity examples/parity/mistake_no_division.py` fails 8, 4,4 and 1,7; exit 1.
"""

import torch
from _token_lm import all_reduce_grads, build_model, full_batch_loss, microbatches, token_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, microbatches: list) -> None:
    for mb in microbatches:
        token_loss(model, mb).backward()
    all_reduce_grads(model)  # a sum over every token of the window: the divisor is missing
