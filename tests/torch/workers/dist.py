"""Worker functions and shared fixtures for the torch tests: importable by the ranks of a local world.

Each ``*_world`` function runs on every rank of a world started by
:func:`gradagg.torch.run_local_world` (``torch.distributed`` already
initialised, gloo on loopback) and returns plain values for the test to assert
on, so that one world runs several checks. The ranks import this module by
name: the launcher hands them the test process's ``sys.path`` (pytest puts
``tests/`` on it through ``pythonpath``).

The model is a tiny top-1 mixture of experts in float64 whose routing is fixed
per sample, so that some experts are absent from some microbatches, one expert
is absent from every microbatch of rank 0, and one layer is never used at all.
"""

from __future__ import annotations

import copy
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.errors import CollectiveError, GradaggError, NonFiniteGradientError, WindowError
from gradagg.reference import owner_sum
from gradagg.torch import (
    MicrobatchAccumulator,
    Ownership,
    ShardSpec,
    clip_grad_norm_,
    count_collectives,
    grad_norm,
    owner_reduce,
)

D_IN, D_H, B = 4, 3, 4  # input width, hidden width, samples per microbatch (equal sizes: see full_batch_grads)
# Expert of each sample, per global microbatch. Microbatches 0-2 never use expert 2; microbatch 1 uses
# only expert 0; microbatch 3 only expert 2. With counts [3, 5], expert 2 is absent from every
# microbatch of rank 0 and present on rank 1.
ROUTES = [
    [0, 1, 0, 1],
    [0, 0, 0, 0],
    [1, 1, 0, 1],
    [2, 2, 2, 2],
    [0, 1, 2, 0],
    [2, 0, 2, 1],
    [1, 1, 1, 1],
    [0, 2, 0, 2],
]
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Grads = dict[str, torch.Tensor | None]


class TinyMoE(nn.Module):
    """shared Linear -> tanh -> one expert Linear per sample (top-1 routing given); ``unused`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in every reference
        self.shared = nn.Linear(D_IN, D_H).double()
        self.experts = nn.ModuleList(nn.Linear(D_H, 1).double() for _ in range(3))
        self.unused = nn.Linear(D_H, 1).double()

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        out = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
        for e in sorted(set(route.tolist())):  # only the experts this microbatch routes to run
            mask = route == e
            out[mask] = self.experts[e](h[mask])
        return out


def microbatches(n: int, seed: int = 1) -> list[Batch]:
    """The first ``n`` global microbatches (x, y, route), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        x = torch.randn(B, D_IN, generator=g, dtype=torch.float64)
        y = torch.randn(B, 1, generator=g, dtype=torch.float64)
        out.append((x, y, torch.tensor(ROUTES[k % len(ROUTES)])))
    return out


def my_share(counts: list[int], rank: int, seed: int = 1) -> list[Batch]:
    """Rank ``rank``'s microbatches when rank r runs ``counts[r]`` consecutive global microbatches."""
    start = sum(counts[:rank])
    return microbatches(sum(counts), seed)[start : start + counts[rank]]


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y, route = batch
    return nn.functional.mse_loss(model(x, route), y)  # the mean over the microbatch's B samples


def grads_of(model: nn.Module) -> Grads:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in inner.named_parameters()}


def full_batch_grads(batches: list[Batch]) -> Grads:
    """The ground truth: one forward/backward of the whole global batch on a fresh model.

    With equal microbatch sizes, the mean over all samples equals the mean over
    microbatches of the microbatch means, which is what accumulation computes.
    """
    model = TinyMoE()
    x, y, route = (torch.cat([b[i] for b in batches]) for i in range(3))
    loss_of(model, (x, y, route)).backward()
    return grads_of(model)


def max_error(got: Grads, want: Grads, *, absent_as_zero: bool = False) -> float:
    """Largest absolute difference; inf when one side has a gradient and the other None (unless told to zero it)."""
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        if absent_as_zero and (g is None or w is None):
            g = torch.zeros_like(w if g is None else g) if g is None else g
            w = torch.zeros_like(g) if w is None else w
        if (g is None) != (w is None):
            return math.inf
        if g is not None and w is not None:
            worst = max(worst, float((g - w).abs().max()))
    return worst


def accumulate(
    model: nn.Module, batches: list[Batch], acc: MicrobatchAccumulator | None = None, **options: Any
) -> tuple[MicrobatchAccumulator, Any]:
    acc = acc or MicrobatchAccumulator(model, **options)
    for batch in batches:
        with acc.microbatch():
            loss_of(model, batch).backward()
    return acc, acc.finish()


# --- accumulation ------------------------------------------------------------------


def accumulation_world(counts: list[int]) -> dict[str, Any]:
    """Plain module, uneven counts: error against the full batch, ledger, collectives, wrong approaches."""
    rank = dist.get_rank()
    model = TinyMoE()
    with count_collectives() as first:
        acc, _ = accumulate(model, my_share(counts, rank))
    model.zero_grad()
    with count_collectives() as c:
        acc, ledger = accumulate(model, my_share(counts, rank), acc=acc)
    got = grads_of(model)
    truth = full_batch_grads(microbatches(sum(counts)))
    return {
        "max_error": max_error(got, truth),
        "none": sorted(n for n, g in got.items() if g is None),
        "collectives": dict(c.by_op),
        "first_collectives": dict(first.by_op),
        "ledger": ledger,
        "report": acc.report(),
        "wrong_participation": max_error(_divide_by_participation(got, ledger), truth),
        "wrong_world_size": max_error(_ddp_style(counts, rank), truth, absent_as_zero=True),
    }


def _divide_by_participation(got: Grads, ledger: Any) -> Grads:
    """Known wrong fix: the same sums divided by each parameter's participation instead of M."""
    m = ledger.microbatches_global
    return {n: None if g is None else g * m / ledger.participation_global[n] for n, g in got.items()}


def _ddp_style(counts: list[int], rank: int) -> Grads:
    """Known wrong fix: each rank divides by its own count, then ranks average (DDP's divide by world size)."""
    model = TinyMoE()
    mine = my_share(counts, rank)
    for batch in mine:
        (loss_of(model, batch) / max(1, len(mine))).backward()
    out: Grads = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad
        dist.all_reduce(g)
        out[name] = g / dist.get_world_size()
    return out


def ddp_world(counts: list[int]) -> dict[str, Any]:
    """DDP-wrapped module (forward inside and outside the with-block) gives the plain module's gradients."""
    rank = dist.get_rank()
    plain = TinyMoE()
    accumulate(plain, my_share(counts, rank))
    out: dict[str, Any] = {}
    for where in ("inside", "outside"):
        ddp = nn.parallel.DistributedDataParallel(TinyMoE())
        acc = MicrobatchAccumulator(ddp)
        with count_collectives() as c:
            for batch in my_share(counts, rank):
                if where == "outside":
                    loss = loss_of(ddp, batch)
                    with acc.microbatch():
                        loss.backward()
                else:
                    with acc.microbatch():
                        loss_of(ddp, batch).backward()
            acc.finish()
        acc.close()
        out[where] = {"diff": max_error(grads_of(ddp), grads_of(plain)), "collectives": c.total}
    return out


def window_failures_world() -> dict[str, Any]:
    """Poisoned window, M = 0, zero microbatches on one rank, stale gradients: every rank decides the same."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    # a microbatch on rank 1 raises after its backward: every rank refuses, then discard and redo cleanly
    model = TinyMoE()
    acc = MicrobatchAccumulator(model)
    batches = my_share([2, 2], rank)
    for k, batch in enumerate(batches):
        try:
            with acc.microbatch():
                loss_of(model, batch).backward()
                if rank == 1 and k == 1:
                    raise RuntimeError("injected failure after backward")
        except RuntimeError:
            pass
    out["poisoned"] = error_of(acc.finish)
    acc.discard()
    accumulate(model, batches, acc)  # the same accumulator: a second live one over the model is refused
    out["after_discard"] = max_error(grads_of(model), full_batch_grads(microbatches(4)))
    # no microbatch anywhere: M = 0
    model.zero_grad()
    out["m_zero"] = error_of(MicrobatchAccumulator(TinyMoE()).finish)
    # rank 0 runs none, rank 1 runs two: rank 0 still contributes zeros and receives the mean
    model = TinyMoE()
    _, ledger = accumulate(model, my_share([0, 2], rank))
    out["one_rank_empty"] = max_error(grads_of(model), full_batch_grads(microbatches(2)))
    out["one_rank_empty_m"] = ledger.microbatches_per_rank
    # rank 0 runs none but kept gradients from before (no zero_grad): refused on every rank
    model = TinyMoE()
    if rank == 0:
        loss_of(model, microbatches(1)[0]).backward()
    acc3 = MicrobatchAccumulator(model)
    if rank == 1:
        for batch in microbatches(1):
            with acc3.microbatch():
                loss_of(model, batch).backward()
    out["stale"] = error_of(acc3.finish)
    # gradients kept from a finished window are never overwritten by the next one (the flat buffer is
    # reused only when no view of it is alive), and a second finish() without microbatches cannot divide
    # again: rank 1 kept stale gradients, so every rank refuses
    model = TinyMoE()
    acc4, _ = accumulate(model, my_share([1, 1], rank))
    kept = model.shared.weight.grad
    kept_copy = kept.clone()
    model.zero_grad()
    accumulate(model, my_share([2, 1], rank, seed=5), acc=acc4)
    out["kept_intact"] = torch.equal(kept, kept_copy)
    out["second_finish"] = error_of(acc4.finish)
    return out


def nonfinite_world() -> dict[str, Any]:
    """NaN in one microbatch of rank 1: every rank holds the same reduced gradients and takes the same decision."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    batches = my_share([2, 3], rank)
    if rank == 1:
        x, y, route = batches[0]
        batches[0] = (x.clone().fill_(math.nan), y, route)
    model = TinyMoE()
    accumulate(model, batches)
    mine = [(n, g) for n, g in grads_of(model).items() if g is not None]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out["identical"] = all(_same_values(a, b) for a, b in zip(gathered[0], gathered[1]))
    out["nan_params"] = sorted(n for n, g in mine if bool(g.isnan().any()))
    out["norm_is_nan"] = math.isnan(float(grad_norm(model.parameters())))
    out["clip_raises"] = error_of(lambda: clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True))
    model = TinyMoE()
    out["raise_mode"] = error_of(lambda: accumulate(model, batches, nonfinite="raise"))
    return out


def _same_values(a: tuple[str, torch.Tensor], b: tuple[str, torch.Tensor]) -> bool:
    return (
        a[0] == b[0] and torch.equal(a[1].isnan(), b[1].isnan()) and torch.equal(a[1].nan_to_num(), b[1].nan_to_num())
    )


def error_of(fn: Any) -> tuple[str, str] | None:
    """``(error class, message)`` of the GradaggError ``fn()`` raises, or None; any other exception propagates."""
    try:
        fn()
    except GradaggError as exc:
        return type(exc).__name__, str(exc)
    return None


# --- ownership, owner_reduce, norms -------------------------------------------------

# Worker letters of the case fixtures -> ranks of a 4-rank world.
RANK_OF = {"a": 0, "b": 1, "c": 2, "q": 3}
CASE_FIXTURES: dict[str, list[list[Any]]] = {
    "ignore replica copy": [["x", "a", "a", 1.0], ["x", "b", "a", 9.0], ["y", "c", "c", 2.0]],
    "empty owners": [],
    "only nonowner": [["z", "b", "a", 1.0]],
    "owner can be late": [["z", "b", "a", 1.0], ["z", "a", "a", 3.0]],
    "several owners": [["b", "b", "b", 1.0], ["a", "a", "a", 2.0]],
    "owner contributions add": [["q", "q", "q", 1.0], ["q", "q", "q", 2.0]],
}


def random_rows(seed: int, world: int, skew: bool) -> list[list[Any]]:
    """Seeded rows: 12 vector shards, owners balanced or all on rank 0, stale replicas (one NaN) on others."""
    g = torch.Generator().manual_seed(seed)
    rows: list[list[Any]] = []
    for s in range(12):
        owner = 0 if skew else s % world
        width = 1 + s % 3
        for w in range(world):
            repeats = 2 if (w == owner and s % 4 == 0) else (0 if (w == owner and s % 5 == 1) else 1)
            for _ in range(repeats):
                value = torch.randn(width, generator=g, dtype=torch.float64).tolist()
                if w != owner and s == 3:
                    value[0] = math.nan  # a stale replica may hold anything: never counted
                rows.append([f"s{s:02d}", w, owner, value])
    return rows


def _rows_to_call(rows: list[list[Any]], rank: int) -> tuple[list[tuple[Any, torch.Tensor]], Ownership]:
    """This rank's (shard, gradient) pairs and the ownership every rank declares, from fixture rows."""
    specs: dict[Any, ShardSpec] = {}
    pairs = []
    for shard, worker, owner, grad in rows:
        t = torch.tensor(grad if isinstance(grad, list) else [grad], dtype=torch.float64)
        specs[shard] = ShardSpec(tuple(t.shape), t.dtype, RANK_OF.get(owner, owner))
        if RANK_OF.get(worker, worker) == rank:
            pairs.append((shard, t))
    return pairs, Ownership(specs)


def _as_rows(result: dict[Any, torch.Tensor], scalar: bool) -> list[list[Any]]:
    return [[s, (t.item() if scalar else t.tolist())] for s, t in result.items()]


def owner_reduce_world() -> dict[str, Any]:
    """owner_reduce against reference.owner_sum on the case fixtures and seeded rows; collectives counted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"cases": {}, "random": {}}
    for label, rows in CASE_FIXTURES.items():
        pairs, own = _rows_to_call(rows, rank)
        got = _as_rows(owner_reduce(pairs, own), scalar=True)
        out["cases"][label] = (got, owner_sum(rows))
    for skew in (False, True):
        rows = random_rows(seed=7, world=world, skew=skew)
        for collective in ("auto", "all_reduce", "all_gather"):
            pairs, own = _rows_to_call(rows, rank)
            with count_collectives() as first:
                held = owner_reduce(pairs, own, collective=collective)
            held_copy = {k: v.clone() for k, v in held.items()}
            with count_collectives() as steady:
                got = _as_rows(owner_reduce(pairs, own, collective=collective), scalar=False)
            out["random"][(skew, collective)] = {
                "equal": got == owner_sum(rows),
                "held_intact": all(torch.equal(held[k], held_copy[k]) for k in held),
                "first": dict(first.by_op),
                "steady": dict(steady.by_op),
            }
    return out


MISMATCHES = {  # what rank 2 declares differently; every rank must raise naming it
    "shape": ("w", ShardSpec((2, 2), torch.float32, 0)),
    "dtype": ("w", ShardSpec((2, 3), torch.float64, 0)),
    "owner": ("w", ShardSpec((2, 3), torch.float32, 1)),
    "missing": ("w", None),
    "extra": ("extra", ShardSpec((1,), torch.float32, 0)),
}


def layout_mismatch_world() -> dict[str, Any]:
    """Rank 1 accumulates a model with one more layer: every rank's first finish() refuses, naming it."""
    model = TinyMoE()
    if dist.get_rank() == 1:
        model.extra = nn.Linear(1, 1).double()
    return {"error": error_of(lambda: accumulate(model, microbatches(1)))}


def mismatch_world() -> dict[str, Any]:
    """Each declaration mismatch on rank 2 is detected on every rank before data moves; then a good one works."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for kind, (shard, spec) in MISMATCHES.items():
        specs = {"w": ShardSpec((2, 3), torch.float32, 0), "b": ShardSpec((3,), torch.float32, 1)}
        if rank == 2:
            if spec is None:
                del specs[shard]
            else:
                specs[shard] = spec
        contributions = {"w": torch.ones(2, 3), "b": torch.ones(3)}
        out[kind] = error_of(lambda c=contributions, s=specs: owner_reduce(c, Ownership(s)))
    good = Ownership({"w": ShardSpec((2, 3), torch.float32, 0), "b": ShardSpec((3,), torch.float32, 1)})
    out["good"] = {s: t.tolist() for s, t in owner_reduce({"w": torch.ones(2, 3), "b": torch.ones(3)}, good).items()}
    out["owner_out_of_group"] = error_of(lambda: Ownership({"w": ShardSpec((1,), torch.float32, 9)}).verify())
    return out


def norm_world() -> dict[str, Any]:
    """Replicated param (owner 0, grad ones(4): |.|^2 = 4) + rank r's expert (grad r + 1): norm^2 = 4 + sum (r+1)^2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rep = torch.zeros(4, requires_grad=True)
    rep.grad = torch.ones(4)
    expert = torch.zeros(1, requires_grad=True)
    expert.grad = torch.full((1,), float(rank + 1))
    specs = {"rep": ShardSpec((4,), torch.float32, 0)}
    specs.update({f"expert{r}": ShardSpec((1,), torch.float32, r) for r in range(world)})
    own = Ownership(specs)
    params = [("rep", rep), (f"expert{rank}", expert), ("rep_tied", rep)]  # the tied copy counts once
    own_tied = Ownership({**specs, "rep_tied": ShardSpec((4,), torch.float32, 1)})
    out: dict[str, Any] = {}
    own_tied.verify()
    with count_collectives() as c:
        out["norm"] = float(grad_norm(params, ownership=own_tied))
    out["collectives"] = dict(c.by_op)
    out["replicated_only"] = float(grad_norm([rep, rep]))  # ownership=None: rank 0 counts, norm 2
    out["clipped"] = float(clip_grad_norm_(params[:2], 1.0, ownership=own))
    out["rep_after_clip"] = rep.grad.tolist()
    return out


# --- failures of the world itself -----------------------------------------------------------


def dying_world(mode: str, collective_timeout_s: float) -> dict[str, Any]:
    """Rank 1 dies (``"die"``) or stalls (``"stall"``) mid-window; rank 0's finish() must raise, not hang."""
    rank = dist.get_rank()
    model = TinyMoE()
    acc, _ = accumulate(model, my_share([2, 2], rank))  # one good window first: the steady state
    model.zero_grad()
    for batch in my_share([2, 2], rank):
        with acc.microbatch():
            loss_of(model, batch).backward()
        if rank == 1 and mode == "die":
            os._exit(3)  # a crash: no cleanup, no goodbye to the peers
        if rank == 1 and mode == "stall":
            time.sleep(collective_timeout_s + 1.5)  # past the peer's timeout, then gone
            os._exit(0)
    start = time.monotonic()
    try:
        acc.finish()
    except CollectiveError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def failing_world() -> int:
    """Rank 1 raises: the launcher must report it by rank, with the exception."""
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken on purpose")
    return dist.get_rank()


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


__all__ = [
    "NonFiniteGradientError",
    "WindowError",
]


def accumulation_world_cuda(counts: list[int]) -> dict[str, Any]:
    """accumulation_world with the model on this rank's CUDA device (NCCL); compared on the CPU."""
    rank = dist.get_rank()
    model = TinyMoE().cuda()
    acc = MicrobatchAccumulator(model)
    for x, y, route in my_share(counts, rank):
        with acc.microbatch():
            nn.functional.mse_loss(model(x.cuda(), route.cuda()), y.cuda()).backward()
    acc.finish()
    got = {n: None if g is None else g.cpu() for n, g in grads_of(model).items()}
    return {"max_error": max_error(got, full_batch_grads(microbatches(sum(counts))))}


def unpicklable_world() -> Any:
    """Returns something that cannot travel back: the launcher must say so, not lose the rank."""
    return lambda: 0
