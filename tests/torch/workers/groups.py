"""Rank workers for :mod:`gradagg.torch.collectives`: which groups communicate, and what is counted."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradagg.torch import count_collectives
from gradagg.torch.collectives import all_gather_object, all_reduce_sum, get_rank, get_world_size, is_distributed


def groups_world() -> dict[str, Any]:
    """The default group of 2, a group of rank 0 alone (rank 1 outside it) and a group of both."""
    alone, both = dist.new_group([0]), dist.new_group([0, 1])
    out: dict[str, Any] = {}
    for label, group in (("default", None), ("alone", alone), ("both", both)):
        with count_collectives() as c:
            total = all_reduce_sum(torch.tensor([float(dist.get_rank() + 1)]), group)
            gathered = all_gather_object(dist.get_rank(), group)
        out[label] = {
            "distributed": is_distributed(group),
            "rank": get_rank(group),
            "world": get_world_size(group),
            "sum": float(total),
            "gathered": gathered,
            "counted": c.total,
        }
    return out


def launcher_world() -> float:
    """WORLD_SIZE set as torchrun sets it, the group initialised: the accumulator builds and sums over both ranks."""
    import os

    from gradagg.torch import MicrobatchAccumulator

    os.environ["WORLD_SIZE"] = str(dist.get_world_size())  # this rank's process only (each rank is its own)
    p = torch.zeros(1, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    with acc.microbatch(weight=1):
        (p * 2.0).sum().backward()
    acc.finish()
    return float(p.grad)  # type: ignore[arg-type]
