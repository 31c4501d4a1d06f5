"""Rank 1's step spins in pure Python forever (no collective, no exit) while the other ranks wait for it.

Rank 0 waits in an all-reduce on the default group (the short collective timeout ends it); with a third
rank, rank 2 waits on a group of ranks 1 and 2 created with torch's default timeout (30 minutes), as the
groups of a 2-d DeviceMesh (HSDP) are: only rank 1's death at the deadline ends its wait.
"""

import time

import torch.distributed as dist
from _tiny import build_model, full_batch_loss, microbatches, right_step, sum_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model, microbatches) -> None:
    pair = dist.new_group([1, 2]) if dist.get_world_size() == 3 else None  # every rank joins new_group
    while dist.get_rank() == 1:
        time.sleep(0.01)
    if dist.get_rank() == 2:
        for x in microbatches:
            sum_loss(model, x).backward()
        dist.all_reduce(model.weight.grad, group=pair)  # no timeout of ours: it waits for rank 1 to die
    right_step(model, microbatches)
