"""Rank workers: DDP with its default buffer broadcast under the accumulator (importable by the ranks).

The model's buffers diverge per rank: ``shift`` is a running mean of the inputs each rank sees, and it is added
to the input, so the gradient depends on it; a BatchNorm adds running statistics and an int64
``num_batches_tracked``. DDP built with its defaults (``broadcast_buffers`` True) broadcasts the buffers from
rank 0 at the first forward of every window (its ``no_sync()`` accumulation); the accumulator keeps that
meaning with one broadcast per ``finish()``, so every window starts with rank 0's buffers.

The truth is computed in one process, in float64: for each window every rank's microbatches run in order on a
copy of the model holding the window's starting state (parameters and rank 0's buffers), each rank's buffers
evolving with its own microbatches; the gradients are summed and divided by M; the next window starts from
rank 0's buffers at the end of this one (unchanged where rank 0 ran none) and the parameters after one SGD step.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator

D_IN, B, LR = 3, 4, 0.1


class Drifting(nn.Module):
    """Linear(BatchNorm(x) + shift), ``shift`` updated to a running mean of the inputs after each forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.norm = nn.BatchNorm1d(D_IN).double()
        self.lin = nn.Linear(D_IN, 1).double()
        self.register_buffer("shift", torch.zeros(D_IN, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(self.norm(x) + self.shift.clone())  # a copy: the update below must not touch the graph
        with torch.no_grad():
            self.shift.mul_(0.5).add_(0.5 * x.mean(0))  # each rank's own data: the buffers diverge
        return out


def batches(window: int, rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s ``n`` microbatches of window ``window`` (the same on every rank and in the truth)."""
    g = torch.Generator().manual_seed(1000 * window + rank)
    return [
        (torch.randn(B, D_IN, generator=g, dtype=torch.float64) * (rank + 1) + rank,
         torch.randn(B, 1, generator=g, dtype=torch.float64))
        for _ in range(n)
    ]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def truth(windows: list[list[int]], *, broadcast: bool = True) -> list[dict[str, Any]]:
    """Per window: the float64 gradient (sum over every rank's microbatches / M) and rank 0's buffers after it.

    ``broadcast=False``: what the ranks would compute if nothing synchronised the buffers (each rank's own
    buffers carried from window to window), to show that the broadcast matters.
    """
    model, out = Drifting(), []
    own: dict[int, dict[str, torch.Tensor]] = {}  # broadcast=False: each rank's buffers
    for k, counts in enumerate(windows):
        start = copy.deepcopy(model.state_dict())
        sums: dict[str, torch.Tensor] = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        rank0_buffers = {n: b.clone() for n, b in model.named_buffers()}
        for rank, n in enumerate(counts):
            model.load_state_dict({**start, **own.get(rank, {})})
            for batch in batches(k, rank, n):
                model.zero_grad(set_to_none=True)
                loss_of(model, batch).backward()
                for name, p in model.named_parameters():
                    sums[name] += p.grad  # type: ignore[operator]
            if rank == 0:
                rank0_buffers = {n: b.clone() for n, b in model.named_buffers()}
            if not broadcast:
                own[rank] = {n: b.clone() for n, b in model.named_buffers()}
        model.load_state_dict(start)
        grads = {n: s / sum(counts) for n, s in sums.items()}
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * grads[name]
            for name, b in model.named_buffers():
                b.copy_(rank0_buffers[name])
        out.append({"grads": grads, "buffers": rank0_buffers})
    return out


def broadcast_world(windows: list[list[int]]) -> dict[str, Any]:
    """DDP(defaults) under the accumulator over ``windows`` (microbatch counts per rank, per window).

    Returns, per window, the largest gradient error against :func:`truth`, whether this rank's buffers equal
    the truth's rank-0 buffers exactly, and DDP's ``forward_sync_buffers`` while held and after ``close()``.
    """
    rank = dist.get_rank()
    ddp = nn.parallel.DistributedDataParallel(Drifting())  # broadcast_buffers / forward_sync_buffers: defaults
    before = ddp.forward_sync_buffers
    acc = MicrobatchAccumulator(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    want = truth(windows)
    errors, buffers_equal = [], []
    for k, counts in enumerate(windows):
        for batch in acc.microbatches(batches(k, rank, counts[rank])):
            with acc.microbatch():
                loss_of(ddp, batch).backward()
        acc.finish()
        got = dict(ddp.module.named_parameters())
        errors.append(max(float((got[n].grad - g).abs().max()) for n, g in want[k]["grads"].items()))  # type: ignore[operator]
        mine = dict(ddp.module.named_buffers())
        buffers_equal.append(all(torch.equal(mine[n], b) for n, b in want[k]["buffers"].items()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    during = ddp.forward_sync_buffers
    acc.close()
    return {"errors": errors, "buffers_equal": buffers_equal, "sync": [before, during, ddp.forward_sync_buffers]}


def ignored_buffer_world() -> dict[str, Any]:
    """``shift`` in DDP's parameters_to_ignore: DDP never syncs it, so neither does finish(); each rank's ``shift``
    stays its own running mean (one microbatch: half its batch's mean), while the BatchNorm statistics are rank 0's.
    """
    rank = dist.get_rank()
    module = Drifting()
    # the only way to fill DDP's parameters_to_ignore (a private name; see tests/torch/workers/ddp_trust.py)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["shift"])
    ddp = nn.parallel.DistributedDataParallel(module)
    acc = MicrobatchAccumulator(ddp)
    batch = batches(0, rank, 1)[0]
    with acc.microbatch():
        loss_of(ddp, batch).backward()
    acc.finish()
    own = 0.5 * batch[0].mean(0)
    out = {"own": torch.equal(module.shift, own), "shift": module.shift.clone(),
           "running_mean": module.norm.running_mean.clone()}
    acc.close()
    return out
