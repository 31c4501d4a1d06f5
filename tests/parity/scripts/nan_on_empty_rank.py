"""Wrong: a per-rank mean computed before the all-reduce; a rank with no microbatch divides 0 by 0 (NaN)."""

import torch
import torch.distributed as dist
from _tiny import build_model, full_batch_loss, microbatches, sum_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model, microbatches) -> None:
    local = float(sum(len(x) for x in microbatches))
    for x in microbatches:
        sum_loss(model, x).backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad /= local  # 0 / 0 on a rank that ran nothing
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
