"""Rank workers: ``zero_grad(set_to_none=False)`` and ``True`` mixed between windows (importable by the ranks).

:class:`tests.torch.workers.fsdp.Blocks` in float64 as a plain replica, under DDP, and under FSDP2 (both forms);
seeded random counts per rank (0 included) and a random ``set_to_none`` per window; every window against the slow
twin (:func:`tests.torch.workers.fsdp_uneven.pure`). Then a window where one rank holds a non-zero leftover on one
parameter (on an FSDP2 parameter: in its local shard): refused on every rank, then discarded, then exact again.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.errors import WindowError
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.placements import local_tensor
from tests.torch.workers import fsdp as fw
from tests.torch.workers import fsdp_uneven as fu
from tests.torch.workers import train as tw

LAYOUTS = ("plain", "ddp", "fsdp shards", "fsdp window")


def _build(layout: str, mesh: Any) -> tuple[nn.Module, nn.Module, MicrobatchAccumulator]:
    """(the module to run, the one holding the parameters by their plain names, its accumulator)."""
    if layout == "plain":
        model = fw.Blocks(torch.float64)
        return model, model, MicrobatchAccumulator(model)
    if layout == "ddp":
        ddp = nn.parallel.DistributedDataParallel(fw.Blocks(torch.float64))
        return ddp, ddp.module, MicrobatchAccumulator(ddp)
    model = fu.model64(mesh)
    return model, model, MicrobatchAccumulator(model, fsdp="window" if layout == "fsdp window" else "shards")


def _window(acc: MicrobatchAccumulator, model: nn.Module, counts: list[int], rank: int) -> None:
    for batch in acc.microbatches(tw.share(tw.token_batches(sum(counts)), counts, rank)):
        with acc.microbatch(weight=int(batch[3].sum())):
            fu.loss64(model, batch).backward()
    acc.finish()


def _error(named: nn.Module, counts: list[int], rank: int) -> float:
    got = fw.full_grads(named)
    want = fu.pure(counts, rank)
    if got.keys() != want.keys():
        return float("inf")
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def mixed_world(seed: int, windows: int) -> dict[str, Any]:
    """Per layout: the plan (counts, set_to_none), each window's error, and the refusal of a stale leftover."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        plan = [([rng.randint(0, 3) for _ in range(world)], rng.random() < 0.5) for _ in range(windows)]
        plan = [(c if sum(c) else [1] * world, none) for c, none in plan]
        model, named, acc = _build(layout, mesh)
        errors = []
        for counts, set_to_none in plan:
            _window(acc, model, counts, rank)
            errors.append(_error(named, counts, rank))
            named.zero_grad(set_to_none=set_to_none)
        holder, refusals = rng.randrange(world), []
        for held_count in (0, 2):  # the holder opens its window in finish() (none run), or in its first microbatch
            counts = [rng.randint(1, 2) for _ in range(world)]
            counts[holder] = held_count
            _window(acc, model, counts, rank)
            named.zero_grad(set_to_none=False)
            if rank == holder:
                with torch.no_grad():
                    local_tensor(named.blocks[0].weight.grad)[0, 0] = 0.5  # type: ignore[index]
            try:
                _window(acc, model, counts, rank)
                refusals.append(None)
            except WindowError as exc:
                refusals.append(str(exc))
            acc.discard()
        _window(acc, model, counts, rank)
        out[layout] = {"plan": plan, "errors": errors, "holder": holder, "refused": refusals,
                       "after": _error(named, counts, rank)}
        acc.close()
    return out
