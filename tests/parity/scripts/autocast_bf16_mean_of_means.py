"""Wrong, autocast_bf16.py's model and loss with the mean of per-microbatch token means (by hand): still caught."""

import _autocast
import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
import torch.distributed as dist
from _token_lm import all_reduce_grads, microbatches
from autocast_bf16 import DTYPE, build_model, full_batch_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, window: list) -> None:
    count = torch.tensor(float(len(window)))
    dist.all_reduce(count)
    for mb in window:
        _autocast.token_loss(model, DTYPE, mb, "mean").backward()
    all_reduce_grads(model)
    for p in model.parameters():
        p.grad /= count
