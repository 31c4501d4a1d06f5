"""Rank workers for the training tests: weights, loss terms, DDP overlap, FSDP2, HSDP (importable by the ranks).

Every ``*_world`` function runs on each rank of a local gloo world (``gradagg.testing``) and returns plain
values; the tests in ``tests/torch/accumulate/test_training.py`` assert on them. The data are *tokens*: each
microbatch holds ``B`` samples of which only some are valid (the others are padding), so a token mean
differs from a mean of microbatch means. The truth is always one forward/backward of the whole global batch
on a fresh model in one process (float64).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.errors import CollectiveError
from gradagg.torch import MicrobatchAccumulator, count_collectives
from tests.torch.workers import dist as w

B = 6  # samples ("tokens") per microbatch, some of them padding
VALID = [6, 2, 5, 0, 3, 6, 1, 4, 6, 2]  # valid tokens of global microbatch k (k % 10); one has none
TokenBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # x, y, route, valid mask


def token_batches(n: int, seed: int = 3) -> list[TokenBatch]:
    """The first ``n`` global microbatches: x, y, expert route and the mask of valid tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        x = torch.randn(B, w.D_IN, generator=g, dtype=torch.float64)
        y = torch.randn(B, 1, generator=g, dtype=torch.float64)
        route = torch.tensor([(k + j) % 3 if k % 4 else 0 for j in range(B)])  # every 4th: expert 0 only
        mask = torch.arange(B) < VALID[k % len(VALID)]
        out.append((x, y, route, mask))
    return out


def share(batches: list[Any], counts: list[int], rank: int) -> list[Any]:
    start = sum(counts[:rank])
    return batches[start : start + counts[rank]]


def token_loss_sum(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Sum over the valid tokens of the squared error: the sum-reduced loss a weighted microbatch backpropagates."""
    x, y, route, mask = batch
    return ((model(x, route) - y)[mask] ** 2).sum()


def aux_loss(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """An auxiliary term normalised per microbatch (a router-style penalty on every sample)."""
    x, _, route, _ = batch
    return model(x, route).pow(2).mean()


def token_truth(batches: list[TokenBatch]) -> w.Grads:
    """One backward of the whole batch: the gradient of the mean over every valid token."""
    model = w.TinyMoE()
    x, y, route, mask = (torch.cat([b[i] for b in batches]) for i in range(4))
    ((model(x, route) - y)[mask] ** 2).mean().backward()
    return w.grads_of(model)


def terms_truth(batches: list[TokenBatch]) -> w.Grads:
    """Full-batch loss of two terms: token mean of the squared error + mean over microbatches of aux_loss."""
    model = w.TinyMoE()
    tokens = sum(int(b[3].sum()) for b in batches)
    loss = sum(token_loss_sum(model, b) for b in batches) / tokens + sum(aux_loss(model, b) for b in batches) / len(
        batches
    )
    loss.backward()  # type: ignore[union-attr]
    return w.grads_of(model)


def run_weighted(model: nn.Module, acc: MicrobatchAccumulator, mine: list[TokenBatch], lookahead: bool) -> Any:
    items = acc.microbatches(mine) if lookahead else mine
    for batch in items:
        with acc.microbatch(weight=int(batch[3].sum())):
            token_loss_sum(model, batch).backward()
    return acc.finish()


def _grads(model: nn.Module) -> w.Grads:
    """Gradients as plain tensors (a DTensor's full tensor: a collective, the same order on every rank)."""
    out: w.Grads = {}
    for n, p in w.grads_of(model).items():
        out[n] = None if p is None else (p.full_tensor() if hasattr(p, "full_tensor") else p)
    return out


# --- plain modules ------------------------------------------------------------------------------------------


def plain_world() -> dict[str, Any]:
    """Weights (uneven, a rank with none), look-ahead with many buckets, loss terms, mixing, unfreezing."""
    rank, out = dist.get_rank(), {}
    data = token_batches(10)
    for label, counts, look, mb in [
        ("uneven", [3, 5], False, 25.0),
        ("zero", [0, 4], True, 1e-4),
        ("buckets", [2, 3], True, 1e-4),
    ]:
        model = w.TinyMoE()
        acc = MicrobatchAccumulator(model, bucket_mb=mb)
        with count_collectives() as c:
            ledger = run_weighted(model, acc, share(data, counts, rank), look)
        out[label] = {
            "error": w.max_error(_grads(model), token_truth(data[: sum(counts)])),
            "ledger": ledger,
            "collectives": dict(c.by_op),
            "buckets": len(acc.state.layout().buckets),
        }
    out["terms"] = _terms(rank, data)
    out["mixed"] = _mixed(rank, data)
    out["failed"] = _failed(rank, data)
    out["unfrozen"] = _unfrozen(rank)
    return out


def _terms(rank: int, data: list[TokenBatch]) -> dict[str, Any]:
    counts = [2, 3]
    mine = share(data, counts, rank)
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    div = acc.divisors({"tokens": sum(int(b[3].sum()) for b in mine), "microbatches": len(mine)})
    for batch in mine:
        with acc.microbatch():
            (token_loss_sum(model, batch) / div["tokens"] + aux_loss(model, batch) / div["microbatches"]).backward()
    ledger = acc.finish()
    return {"error": w.max_error(_grads(model), terms_truth(data[:5])), "ledger": ledger, "divisors": div}


def _mixed(rank: int, data: list[TokenBatch]) -> Any:
    """Rank 0 weights its microbatches, rank 1 does not: both ranks refuse."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    with acc.microbatch(weight=3 if rank == 0 else None):
        token_loss_sum(model, data[rank]).backward()
    return w.error_of(acc.finish)


def _failed(rank: int, data: list[TokenBatch]) -> dict[str, Any]:
    """Rank 0 weighted and with a .grad set by hand after its microbatch, rank 1 unweighted: finish() refused on
    both ranks for both reasons; the window stays open (a step refused) and refused when finished again."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    with acc.microbatch(weight=3 if rank == 0 else None):
        token_loss_sum(model, data[rank]).backward()
    if rank == 0:
        model.shared.weight.grad = torch.ones_like(model.shared.weight)
    out = {"first": w.error_of(acc.finish), "step": w.error_of(torch.optim.SGD(model.parameters(), lr=0.1).step),
           "again": w.error_of(acc.finish)}
    acc.discard()
    acc.close()
    return out


def _unfrozen(rank: int) -> Any:
    """``unused`` is frozen at construction, then unfrozen on rank 1 only: every rank refuses."""
    model = w.TinyMoE()
    model.unused.requires_grad_(False)
    acc = MicrobatchAccumulator(model)
    if rank == 1:
        model.unused.requires_grad_(True)
    with acc.microbatch():
        w.loss_of(model, w.microbatches(1)[0]).backward()
    return w.error_of(acc.finish)


def zero_grad_world(form: str) -> dict[str, Any]:
    """optimizer.zero_grad() between the microbatches of a window (either form): every microbatch still counts."""
    rank = dist.get_rank()
    counts = [2, 3]
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = MicrobatchAccumulator(model)
    for batch in w.my_share(counts, rank):
        opt.zero_grad(set_to_none=(form == "none"))
        with acc.microbatch():
            w.loss_of(model, batch).backward()
    ledger = acc.finish()
    return {"error": w.max_error(w.grads_of(model), w.full_batch_grads(w.microbatches(5))), "m": ledger.divisor}


class ComplexNet(nn.Module):
    """y = Re(conj(w) . z) + b with a complex weight: the gradient of a real loss in a complex parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, dtype=torch.complex128))
        self.b = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z @ self.w.conj()).real + self.b


def complex_world() -> dict[str, Any]:
    """Complex parameters over 2 ranks (counts 1 and 2) against the full batch."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(4)
    zs = [torch.randn(2, 3, dtype=torch.complex128, generator=g) for _ in range(3)]
    ys = [torch.randn(2, dtype=torch.float64, generator=g) for _ in range(3)]
    model = ComplexNet()
    acc = MicrobatchAccumulator(model)
    for k in ([0], [1, 2])[rank]:
        with acc.microbatch():
            ((model(zs[k]) - ys[k]) ** 2).mean().backward()
    acc.finish()
    truth = ComplexNet()
    ((truth(torch.cat(zs)) - torch.cat(ys)) ** 2).mean().backward()
    return {"error": w.max_error(w.grads_of(model), w.grads_of(truth)), "dtype": str(model.w.grad.dtype)}


def attach_world() -> dict[str, Any]:
    """acc.attach(optimizer): optimizer.step() finishes the window first; the update uses the mean (counts 1, 3)."""
    rank = dist.get_rank()
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = MicrobatchAccumulator(model)
    acc.attach(opt)
    for batch in w.my_share([1, 3], rank):
        with acc.microbatch():
            w.loss_of(model, batch).backward()
    opt.step()
    truth = w.TinyMoE()
    want = {n: p.detach() - 0.5 * g for (n, p), g in zip(truth.named_parameters(), _truth_list(truth))}
    got = dict(model.named_parameters())
    return {
        "error": max(float((got[n] - v).abs().max()) for n, v in want.items()),
        "divisor": acc.ledger.divisor,
    }


def _truth_list(model: nn.Module) -> list[torch.Tensor]:
    truth = w.full_batch_grads(w.microbatches(4))
    return [torch.zeros_like(p) if truth[n] is None else truth[n] for n, p in model.named_parameters()]  # type: ignore[misc]


# --- DDP ------------------------------------------------------------------------------------------------------


def ddp_world() -> dict[str, Any]:
    """DDP, weighted, uneven counts with a zero rank, look-ahead with many buckets: the same as the plain module."""
    rank, out = dist.get_rank(), {}
    data = token_batches(10)
    for label, counts, mb in [("zero", [0, 4], 1e-4), ("buckets", [3, 5], 1e-4)]:
        ddp = nn.parallel.DistributedDataParallel(w.TinyMoE())
        acc = MicrobatchAccumulator(ddp, bucket_mb=mb)
        with count_collectives() as c:
            ledger = run_weighted(ddp, acc, share(data, counts, rank), lookahead=True)
        out[label] = {
            "error": w.max_error(_grads(ddp.module), token_truth(data[: sum(counts)])),
            "ledger": ledger,
            "collectives": dict(c.by_op),
            "buckets": len(acc.state.layout().buckets),
        }
        acc.close()
    return out


# --- FSDP2 and HSDP -------------------------------------------------------------------------------------------


def sharded_moe(mesh: Any, experts: bool = True) -> nn.Module:
    """TinyMoE with fully_shard on each expert (optional), on the shared layer and on the root."""
    from torch.distributed.fsdp import fully_shard

    model = w.TinyMoE()
    if experts:
        for e in model.experts:
            fully_shard(e, mesh=mesh)
    fully_shard(model.shared, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_world() -> dict[str, Any]:
    """FSDP2 on 2 ranks: window mode with uneven counts (zero included), weights, two windows; every_microbatch."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, out = dist.get_rank(), {}
    mesh = init_device_mesh("cpu", (2,))
    data = token_batches(10)
    for label, counts in [("uneven", [3, 5]), ("zero", [0, 4])]:
        model = sharded_moe(mesh)  # experts routed by data: FSDP's per-expert collectives need the window form
        acc = MicrobatchAccumulator(model, fsdp="window", bucket_mb=1e-4 if label == "zero" else 25.0)  # zero: buckets
        runs = []
        for window in range(2):  # the second window reuses the unsharded parameters' hooks
            with count_collectives() as c:
                ledger = run_weighted(model, acc, share(data, counts, rank), lookahead=window == 1)
            kinds = sorted({type(p.grad).__name__ for p in model.parameters() if p.grad is not None})
            runs.append(
                {
                    "error": w.max_error(_grads(model), token_truth(data[: sum(counts)])),
                    "ledger": ledger,
                    "collectives": dict(c.by_op),
                    "grad_types": kinds,
                    "buckets": len(acc.state.layout().buckets),
                }
            )
            model.zero_grad()
        out[label] = runs
    out["every_microbatch"] = _every_microbatch(mesh, rank, data)
    out["shards"] = _shards(mesh, rank, data)
    return out


def _shards(mesh: Any, rank: int, data: list[TokenBatch]) -> dict[str, Any]:
    """The default form, counts 3/5 and 0/4 with no padding by hand (gradagg pads), look-ahead and bare calls."""
    model = sharded_moe(mesh, experts=False)
    acc = MicrobatchAccumulator(model)
    out = {}
    for counts, look in [([3, 5], True), ([0, 4], False), ([0, 4], True), ([3, 5], False)]:
        ledger = run_weighted(model, acc, share(data, counts, rank), lookahead=look)
        out[f"{counts} {look}"] = (w.max_error(_grads(model), token_truth(data[: sum(counts)])), ledger.divisor)
        model.zero_grad()
    return out


def _every_microbatch(mesh: Any, rank: int, data: list[TokenBatch]) -> dict[str, Any]:
    """Counts 3 and 5 padded to 5 each: rank 0 adds two weight-0 microbatches (a copy of its last, times 0)."""
    model = sharded_moe(mesh, experts=False)  # FSDP's own reduce-scatters: the same groups run on every rank
    acc = MicrobatchAccumulator(model, fsdp="every_microbatch")
    mine = share(data, [3, 5], rank)
    padded = [(b, True) for b in mine] + [(mine[-1], False)] * (5 - len(mine))
    for batch, real in padded:
        with acc.microbatch(weight=int(batch[3].sum()) if real else 0):
            (token_loss_sum(model, batch) * (1.0 if real else 0.0)).backward()
    ledger = acc.finish()
    return {"error": w.max_error(_grads(model), token_truth(data[:8])), "ledger": ledger}


def hsdp_world() -> dict[str, Any]:
    """HSDP on 4 ranks, mesh (replicate 2, shard 2): counts 1, 0, 3, 2 with weights."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    data = token_batches(10)
    counts = [1, 0, 3, 2]
    model = sharded_moe(mesh)  # experts routed by data: the window form
    acc = MicrobatchAccumulator(model, fsdp="window")
    with count_collectives() as c:
        ledger = run_weighted(model, acc, share(data, counts, rank), lookahead=True)
    placements = str(model.shared.weight.grad.placements)
    every = sharded_moe(mesh, experts=False)
    acc2 = MicrobatchAccumulator(every, fsdp="every_microbatch")
    mine = share(data, counts, rank)
    padded = [(b, True) for b in mine] + [(data[0], False)] * (3 - len(mine))
    for batch, real in acc2.microbatches(padded):  # look-ahead: the replica all-reduce only in the last backward
        with acc2.microbatch(weight=int(batch[3].sum()) if real else 0):
            (token_loss_sum(every, batch) * (1.0 if real else 0.0)).backward()
    acc2.finish()
    every_error = w.max_error(_grads(every), token_truth(data[:6]))
    acc2.close()
    every.zero_grad()
    acc3 = MicrobatchAccumulator(every)  # the default: gradagg pads ranks 0, 1, 3 by itself
    run_weighted(every, acc3, mine, lookahead=True)
    return {
        "shards_error": w.max_error(_grads(every), token_truth(data[:6])),
        "every_microbatch_error": every_error,
        "error": w.max_error(_grads(model), token_truth(data[:6])),
        "ledger": ledger,
        "collectives": dict(c.by_op),
        "placements": placements,
    }


def fsdp_dying_world(timeout_s: float) -> dict[str, Any]:
    """Rank 1 exits inside an FSDP2 window after one microbatch; rank 0's finish() must raise, not hang."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    model = sharded_moe(init_device_mesh("cpu", (2,)))  # experts routed by data: the window form
    acc = MicrobatchAccumulator(model, fsdp="window")
    data = token_batches(4)
    for batch in share(data, [2, 2], rank):
        with acc.microbatch(weight=int(batch[3].sum())):
            token_loss_sum(model, batch).backward()
        if rank == 1:
            os._exit(3)
    start = time.monotonic()
    try:
        acc.finish()
    except CollectiveError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start, "timeout": timeout_s}
