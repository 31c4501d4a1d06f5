"""Wrong: each rank's token mean, averaged over the ranks (what DDP's gradient average does to a local mean).

Right in one process (one rank, one mean), wrong as soon as the ranks hold different token counts:
`gradagg parity examples/parity/mistake_mean_of_rank_means.py` passes 8, fails 4,4 (58 tokens
against 37) and 1,7; exit 1. A test that fed every rank the same data would pass it.
"""

import torch
import torch.distributed as dist
from _token_lm import all_reduce_grads, build_model, full_batch_loss, microbatches, n_tokens, token_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, microbatches: list) -> None:
    local_tokens = sum(n_tokens(mb) for mb in microbatches)  # this rank's tokens only
    for mb in microbatches:
        (token_loss(model, mb) / local_tokens).backward()
    all_reduce_grads(model)
    for p in model.parameters():
        p.grad /= dist.get_world_size()
