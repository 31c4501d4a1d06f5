"""Rank workers: the fast accumulator against its slow twin, :class:`gradagg.torch.pure.PureAccumulator`.

The twin runs on a plain replica of the model; the fast one on the same model plain, DDP-wrapped and under
FSDP2, with the same microbatches (uneven counts, a rank with none, token weights or none). Every gradient
must agree, and a parameter must be None under one exactly when it is None under the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.pure import PureAccumulator
from tests.torch.workers import dist as w
from tests.torch.workers import train as tw

# ddp_views: gradient_as_bucket_view, find_unused_parameters; fsdp2: experts sharded (routed by data), the window
# form; fsdp2_shards: experts inside the root's unit, the default (shards) form, padding uneven counts itself
FORMS = ("plain", "ddp", "ddp_views", "fsdp2", "fsdp2_shards")
COUNTS = ([0, 4], [3, 5], [1, 0])


def loss_and_weight(model: nn.Module, batch: tw.TokenBatch, weighted: bool) -> tuple[torch.Tensor, int | None]:
    """Weighted: the sum over valid tokens, weight = their number; unweighted: the microbatch mean (D = M)."""
    if weighted:
        return tw.token_loss_sum(model, batch), int(batch[3].sum())
    x, y, route, _ = batch
    return nn.functional.mse_loss(model(x, route), y), None


def run(acc: Any, model: nn.Module, mine: list[tw.TokenBatch], weighted: bool) -> None:
    for batch in mine:
        loss, weight = loss_and_weight(model, batch, weighted)
        with acc.microbatch(weight=weight):
            loss.backward()
    acc.finish()


def wrapped(form: str, mesh: Any) -> tuple[nn.Module, nn.Module]:
    """(what the accumulator is given, what runs the forward) for a fresh TinyMoE."""
    if form.startswith("fsdp2"):
        sharded = tw.sharded_moe(mesh, experts=form == "fsdp2")
        return sharded, sharded
    model = w.TinyMoE()
    if form in ("ddp", "ddp_views"):
        views = form == "ddp_views"
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=views, find_unused_parameters=views)
        return ddp, ddp
    return model, model


def full(model: nn.Module) -> dict[str, torch.Tensor | None]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out: dict[str, torch.Tensor | None] = {}
    for n, p in inner.named_parameters():
        g = p.grad
        out[n] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().double()
    return out


def twins_world() -> dict[tuple[str, bool, str], Any]:
    """Every (counts, weighted, form): the largest difference from the twin, and whether None-ness agreed."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,))
    data, out = tw.token_batches(10), {}
    for counts in COUNTS:
        mine = tw.share(data, counts, rank)
        for weighted in (False, True):
            if weighted and sum(int(b[3].sum()) for b in tw.share(data, counts, 0) + tw.share(data, counts, 1)) == 0:
                continue
            replica = w.TinyMoE()
            run(PureAccumulator(replica.parameters()), replica, mine, weighted)
            want = full(replica)
            for form in FORMS:
                given, forward = wrapped(form, mesh)
                acc = MicrobatchAccumulator(given, fsdp="window" if form == "fsdp2" else "shards")
                run(acc, forward, mine, weighted)
                got = full(given)
                acc.close()
                same_none = all((got[n] is None) == (want[n] is None) for n in want)
                both = [n for n in want if got[n] is not None and want[n] is not None]
                error = max((float((got[n] - want[n]).abs().max()) for n in both), default=0.0)  # type: ignore[operator]
                none = sorted(n for n in want if want[n] is None)
                out[(str(counts), weighted, form)] = {"error": error, "same_none": same_none, "none": none}
    return out
