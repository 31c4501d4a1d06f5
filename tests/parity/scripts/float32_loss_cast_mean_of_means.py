"""Wrong, float32_loss_cast.py's model and loss with the mean of per-microbatch token means: still caught."""

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
import torch.distributed as dist
from _token_lm import all_reduce_grads, build_model, microbatches
from float32_loss_cast import cast_loss, full_batch_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, window: list) -> None:
    count = torch.tensor(float(len(window)), dtype=torch.float64)
    dist.all_reduce(count)
    for inputs, targets in window:
        cast_loss(model, inputs, targets, "mean").backward()
    all_reduce_grads(model)
    for p in model.parameters():
        p.grad /= count
