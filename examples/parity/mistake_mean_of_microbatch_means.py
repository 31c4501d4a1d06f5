"""Wrong: the mean of per-microbatch token means.

Each microbatch's loss is its own token mean, and the gradients are averaged over the M microbatches:
a microbatch of 3 tokens weighs as much as one of 24. Wrong on every layout, one process included:
`gradagg parity examples/parity/mistake_mean_of_microbatch_means.py` fails 8, 4,4 and 1,7; exit 1.
"""

import torch
import torch.distributed as dist
from _token_lm import all_reduce_grads, build_model, full_batch_loss, microbatches, token_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, microbatches: list) -> None:
    count = torch.tensor(float(len(microbatches)), dtype=torch.float64)
    dist.all_reduce(count)  # M, the microbatches of the window
    for mb in microbatches:
        token_loss(model, mb, reduction="mean").backward()  # this microbatch's token mean
    all_reduce_grads(model)
    for p in model.parameters():
        p.grad /= count
