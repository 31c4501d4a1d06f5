"""Right, with gradagg: each microbatch weighted by its valid tokens, the divisor counted for you.

Backpropagate each microbatch's loss SUMMED over its tokens inside ``acc.microbatch(weight=tokens)``;
``finish()`` sums the gradients over every microbatch of every rank and divides by D, the sum of all
the weights (the window's 95 tokens), counted in the same collective. A rank with no microbatch just
calls ``finish()``. `gradagg parity examples/parity/token_mean_gradagg.py` exits 0: every default
layout (8; 4,4; 1,7) passes.
"""

import torch
from _token_lm import build_model, full_batch_loss, microbatches, n_tokens, token_loss

from gradagg.torch import MicrobatchAccumulator

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, microbatches: list) -> None:
    acc = MicrobatchAccumulator(model)
    for mb in acc.microbatches(microbatches):  # marks the last one, so its backward already sends
        with acc.microbatch(weight=n_tokens(mb)):
            token_loss(model, mb).backward()  # the sum over tokens: the accumulator divides by D
    acc.finish()
    acc.close()
