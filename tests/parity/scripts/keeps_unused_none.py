"""Right about absence: the same model as zero_for_unused.py, and the unused layer's grad stays None."""

import torch
import torch.distributed as dist
from _tiny import count_and_backward, full_batch_loss, microbatches
from zero_for_unused import build_model

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model, microbatches) -> None:
    count = count_and_backward(model, microbatches)
    for p in model.used.parameters():  # every rank knows which layer the loss uses; a rank with none adds zeros
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= count
