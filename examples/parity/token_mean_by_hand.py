"""Right: the gradient of the global token mean, by hand.

Backpropagate each microbatch's loss SUMMED over its tokens, sum the gradients over the ranks, and
divide by the token count of the whole window, counted on every rank and all-reduced.
`gradagg parity examples/parity/token_mean_by_hand.py` exits 0: every default layout (8; 4,4; 1,7) passes.
"""

import torch
import torch.distributed as dist
from _token_lm import all_reduce_grads, build_model, full_batch_loss, microbatches, n_tokens, token_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, microbatches: list) -> None:
    tokens = torch.tensor(float(sum(n_tokens(mb) for mb in microbatches)), dtype=torch.float64)
    dist.all_reduce(tokens)  # the divisor: every valid token of the window, on all ranks
    for mb in microbatches:
        token_loss(model, mb).backward()  # the sum over tokens: no division yet
    all_reduce_grads(model)
    for p in model.parameters():
        p.grad /= tokens
