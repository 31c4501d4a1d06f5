"""Rank workers for the default FSDP2 form (``fsdp="shards"``) with uneven counts: gradagg pads by itself.

Each ``*_world`` runs on every rank of a gloo world and returns plain values (float64 full gradients, counts,
error types and messages). The model is :class:`tests.torch.workers.fsdp.Blocks` in float64, ``fully_shard`` on
each block and the root; the references are the float64 one-process full batch (:func:`fsdp.truth64`) and
:class:`gradagg.torch.pure.PureAccumulator` on a plain replica fed the same microbatches.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.errors import GradaggError
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.pure import PureAccumulator
from tests.torch.workers import fsdp as fw
from tests.torch.workers import train as tw

# How the loop is written: acc.microbatches() (the agreement before each item); bare microbatch() calls with
# the forward inside the with, or before it (the forward's pre-hook agrees); pad=fn instead of the replay.
STYLES = ("microbatches", "bare", "forward first", "pad=fn")
SEED = 15


def loss64(model: nn.Module, batch: tw.TokenBatch) -> torch.Tensor:
    """The sum over valid tokens of the squared error, in float64."""
    x, y, _, mask = batch
    return ((model(x) - y)[mask] ** 2).sum()


def model64(mesh: Any, layout: str = "root") -> fw.Blocks:
    return fw.shard(fw.Blocks(torch.float64), mesh, fw.policy(None), layout)


def window(acc: MicrobatchAccumulator, model: nn.Module, mine: list[tw.TokenBatch], style: str) -> Any:
    """One window of token-weighted microbatches, written in ``style``; the ledger."""
    items = acc.microbatches(mine) if style in ("microbatches", "pad=fn") else mine
    for batch in items:
        n = int(batch[3].sum())
        if style == "forward first":
            loss = loss64(model, batch)
            with acc.microbatch(weight=n):
                loss.backward()
        else:
            with acc.microbatch(weight=n):
                loss64(model, batch).backward()
    return acc.finish()


def pure(counts: list[int], rank: int) -> dict[str, torch.Tensor]:
    """The slow twin on a plain float64 replica, the same microbatches."""
    replica = fw.Blocks(torch.float64)
    acc = PureAccumulator(list(replica.parameters()))
    for batch in tw.share(tw.token_batches(sum(counts)), counts, rank):
        with acc.microbatch(weight=int(batch[3].sum())):
            loss64(replica, batch).backward()
    acc.finish()
    return {n: p.grad.detach().clone() for n, p in replica.named_parameters() if p.grad is not None}


def fuzz_world(windows: int, ranks: int) -> list[dict[str, Any]]:
    """Seeded random counts 0..4 per rank (at least one microbatch somewhere), one accumulator per style over
    ``windows`` windows: each window's gradients, D, M, and the rounds this rank ran (real and padding)."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (ranks,))
    rng = random.Random(SEED)
    plans = [[rng.randint(0, 4) for _ in range(ranks)] for _ in range(windows * len(STYLES))]
    plans = [p if sum(p) else [1] + p[1:] for p in plans]
    out = []
    for k, style in enumerate(STYLES):
        model = model64(mesh)
        pad = functools.partial(loss64, model, tw.token_batches(1)[0]) if style == "pad=fn" else "replay"
        acc = MicrobatchAccumulator(model, pad=pad)
        for counts in plans[k * windows : (k + 1) * windows]:
            ledger = window(acc, model, tw.share(tw.token_batches(sum(counts)), counts, rank), style)
            out.append({
                "style": style, "counts": counts, "grads": fw.full_grads(model), "pure": pure(counts, rank),
                "divisor": ledger.divisor, "m": ledger.microbatches_global,
                "rounds": ledger.microbatches_local + acc.state.padded_last,
            })
            model.zero_grad()
        acc.close()
    return out


def refusal_world() -> dict[str, Any]:
    """pad=None: even counts run; uneven ones (1, 3) raise GradaggError on both ranks, in microbatches() on rank
    1 and in finish() (bare calls) on rank 0, the window dropped; the accumulator then runs an even window."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, mesh, out = dist.get_rank(), init_device_mesh("cpu", (2,)), {}
    model = model64(mesh)
    acc = MicrobatchAccumulator(model, pad=None)
    data = tw.token_batches(4)
    out["even"] = window(acc, model, tw.share(data, [2, 2], rank), "microbatches").divisor
    model.zero_grad()
    for style in ("microbatches", "bare"):
        try:
            window(acc, model, tw.share(data, [1, 3], rank), style)
            out[style] = None
        except GradaggError as exc:
            out[style] = (type(exc).__name__, str(exc), all(p.grad is None for p in model.parameters()))
    out["after"] = window(acc, model, tw.share(data, [2, 2], rank), "bare").divisor
    return out


def hsdp_world(counts: list[int]) -> dict[str, Any]:
    """HSDP, mesh (replicate 2, shard 2), the given counts, look-ahead (the replica all-reduce in the last round)
    and bare calls; the plain head of the "blocks only" layout beside the DTensor shards."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for layout in ("root", "blocks only"):
        for style in ("microbatches", "bare"):
            model = model64(mesh, layout)
            acc = MicrobatchAccumulator(model)
            ledger = window(acc, model, tw.share(tw.token_batches(sum(counts)), counts, rank), style)
            out[(layout, style)] = {"grads": fw.full_grads(model), "divisor": ledger.divisor,
                                    "padded": acc.state.padded_last}
            acc.close()
    return out


def full_dtensor_world(counts: list[int], mode: str) -> dict[str, Any]:
    """torchtitan's ``full_dtensor`` backend, built the same way: parameters Replicate() DTensors on a mesh named
    ("dp_shard",) before ``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))``, so the
    unsharded parameters are DTensors too; inputs Shard(0) DTensors (``parallelize_inputs``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_module

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = distribute_module(fw.Blocks(torch.float64), mesh)  # every parameter Replicate()
    dims = DataParallelMeshDims(shard="dp_shard")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    acc = MicrobatchAccumulator(model, fsdp=mode)  # type: ignore[arg-type]

    def spmd(t: torch.Tensor) -> Any:
        return DTensor.from_local(t, mesh, [Shard(0)])

    for x, y, _, mask in acc.microbatches(tw.share(tw.token_batches(sum(counts)), counts, rank)):
        with acc.microbatch(weight=int(mask.sum())):
            err = model(spmd(x.double())) - spmd(y.double())
            (err.pow(2) * spmd(mask.double().unsqueeze(-1))).sum().backward()
    ledger = acc.finish()
    return {"grads": fw.full_grads(model), "divisor": ledger.divisor, "kinds": sorted({
        f"{type(p.grad).__name__} {tuple(p.grad.placements)}" for p in model.parameters() if p.grad is not None})}
