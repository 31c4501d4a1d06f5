"""Loss terms counted as the window runs (issue 23 item 2): RL-like windows, their float64 truth, rank workers.

A window is a fixed list of sequences (padded rows of ``L`` tokens, uneven valid lengths, one fully masked). The
model is a float64 trunk (Linear, tanh) with a policy head and a value head. Four terms, each with its own count:

* ``policy``, token-mean: ``(pi_t - y_t)^2`` over valid tokens (``modes.token_mean``);
* ``kl``, seq-mean-token-mean: ``softplus(pi_t)`` (``modes.seq_mean_token_mean``);
* ``nll`` over the tokens that survive a filter inside the loss (``(pi_t - y_t)^2 < CUT``), its count given by
  ``acc.count`` only after the rank's last microbatch (NeMo-RL#4171);
* ``value``, the mean over microbatches of each microbatch's valid-token mean of ``(v_t - r_s)^2`` (count 1 per
  microbatch, D = M: split-dependent by definition, so the truth is computed for each split).

A split gives each rank its microbatches (lists of sequence indices; a rank may have none). The truth is one
float64 backward of the window's loss in one process; the known wrong divisors (each microbatch's own count, each
rank's own count) are computed the same way, to show that the checks tell them apart.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.modes import seq_mean_token_mean, token_mean
from gradagg.torch.pure import PureAccumulator
from tests.torch.workers.dist import error_of

D, H, L, N = 3, 4, 6, 10  # features, hidden width, tokens per row, sequences in the window
CUT = 0.5  # the in-loss filter of the nll term
TERMS = ("policy", "kl", "nll", "value")
INVARIANT = ("policy", "kl", "nll")  # their window values do not depend on the split
Split = list[list[list[int]]]  # rank -> microbatches -> sequence indices


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(D, H, dtype=torch.float64)
        self.pi = nn.Linear(H, 1, dtype=torch.float64)
        self.v = nn.Linear(H, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.pi(h).squeeze(-1), self.v(h).squeeze(-1)


def window() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, L, D), y (N, L), mask (N, L) with lengths 1..L and sequence 3 fully masked, r (N,) the returns."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, L, D, generator=g, dtype=torch.float64)
    y = torch.randn(N, L, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, L + 1, (N,), generator=g)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    mask[3] = False
    return x, y, mask, torch.randn(N, generator=g, dtype=torch.float64)


def term_losses(model: Model, rows: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One microbatch's (numerator, count) of every term; the nll count is the filter's survivors."""
    x, y, mask, r = (t[rows] for t in window())
    pi, v = model(x)
    sq = (pi - y) ** 2
    policy, kl = token_mean(sq, mask), seq_mean_token_mean(F.softplus(pi), mask)
    keep = mask & (sq.detach() < CUT)
    n_valid = mask.sum()
    value = ((v - r[:, None]) ** 2 * mask).sum() / n_valid.clamp(min=1)
    return {"policy": tuple(policy), "kl": tuple(kl), "nll": ((sq * keep).sum(), keep.sum()),  # type: ignore[dict-item]
            "value": (value, torch.tensor(1))}


def window_loss(model: Model, split: Split, terms: tuple[str, ...], how: str = "exact") -> torch.Tensor:
    """The window's loss in one process: each term's sum over every microbatch / its divisor. ``how``: ``exact``
    (the count over the window on all ranks), ``per_microbatch`` (each microbatch by its own count, then the mean
    over microbatches: NeMo-RL#3791's form), ``per_rank`` (each rank by its own count, then the mean over ranks)."""
    micro = [(r, term_losses(model, rows)) for r, mbs in enumerate(split) for rows in mbs]
    total = torch.zeros((), dtype=torch.float64)
    for t in terms:
        if how == "per_microbatch":
            total = total + sum(p[t][0] / p[t][1].clamp(min=1) for _, p in micro) / len(micro)
            continue
        groups = [[p for r, p in micro if r == k] for k in range(len(split))] if how == "per_rank" else [
            [p for _, p in micro]]
        groups = [g for g in groups if g]
        total = total + sum(sum(p[t][0] for p in g) / sum(p[t][1] for p in g) for g in groups) / len(groups)
    return total


def truth(split: Split, terms: tuple[str, ...] = TERMS, how: str = "exact") -> list[torch.Tensor | None]:
    model = Model()
    window_loss(model, split, terms, how).backward()  # type: ignore[no-untyped-call]
    return grads_of(model)


def run(acc: Any, model: nn.Module, mine: list[list[int]], terms: tuple[str, ...] = TERMS) -> None:
    """This rank's microbatches: every term's backward (retain_graph for all but the last), nll counted after.
    Through ``acc.microbatches()`` where the accumulator has it: the last microbatch is marked."""
    survivors = 0
    for rows in acc.microbatches(mine) if hasattr(acc, "microbatches") else mine:
        with acc.microbatch() as mb:
            parts = term_losses(model, rows)  # type: ignore[arg-type]
            for k, t in enumerate(terms):
                loss, n = parts[t]
                last = k == len(terms) - 1
                if t == "nll":
                    mb.backward(t, loss, retain_graph=not last)
                    survivors += int(n)
                else:
                    mb.backward(t, loss, count=n, retain_graph=not last)
    if "nll" in terms:
        acc.count("nll", survivors)  # known only after the last microbatch


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def max_error(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> float:
    """The largest difference; a gradient None on one side only is infinitely wrong (absent is not zero)."""
    return max(
        (0.0 if g is None and w is None else float("inf") if g is None or w is None else float((g - w).abs().max()))
        for g, w in zip(got, want)
    )


def accumulate(kind: str, split: Split, terms: tuple[str, ...] = TERMS) -> tuple[float, Any]:
    """One window of ``kind`` (plain, ddp, pure) over ``split``: max error against the truth, and the ledger."""
    model, rank = Model(), dist.get_rank()
    wrapped: nn.Module = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
    if kind == "pure":
        acc: Any = PureAccumulator(list(model.parameters()), terms=terms)
    else:  # buckets of ~8 float64 elements: several, so that a bucket sent early would show (none is, with terms)
        acc = MicrobatchAccumulator(wrapped, terms=terms, bucket_mb=8 * 8 / 2**20)
    run(acc, wrapped, split[rank], terms)
    ledger = acc.finish()
    if kind != "pure":
        acc.close()
    return max_error(grads_of(model), truth(split, terms)), ledger


def random_split(rng: random.Random, world: int) -> Split:
    """Every sequence on a random rank (a rank may get none), each rank's cut into random microbatches."""
    split: Split = [[] for _ in range(world)]
    owner = [rng.randrange(world) for _ in range(N)]
    for r in range(world):
        seqs = [s for s in range(N) if owner[s] == r]
        while seqs:
            k = rng.randint(1, len(seqs))
            split[r].append(seqs[:k])
            seqs = seqs[k:]
    return split


UNEVEN: Split = [[[0, 1, 2], [3], [4, 5]], [[6, 7, 8, 9]]]  # 3 and 1 microbatches
ZERO: Split = [[], [[0, 1], [2, 3, 4, 5], [6], [7, 8, 9]]]  # rank 0 runs none


def exact_world(seed: int, fuzz: int) -> dict[str, Any]:
    """Plain, DDP and the pure twin on uneven splits (a rank with none); then ``fuzz`` random splits, plain, of the
    split-invariant terms: each within 1e-12 of the same truth, which the wrong divisors miss."""
    out: dict[str, Any] = {}
    for name, split in (("uneven", UNEVEN), ("zero", ZERO)):
        for kind in ("plain", "ddp", "pure"):
            err, ledger = accumulate(kind, split)
            out[f"{name}/{kind}"] = err
            if kind == "plain":
                out[f"{name}/ledger"] = (ledger.terms, ledger.terms_local, ledger.weighting, ledger.report())
    rng = random.Random(seed)
    want = truth([[list(range(N))]], INVARIANT)
    fuzzed = []
    for _ in range(fuzz):
        split = random_split(rng, dist.get_world_size())
        model = Model()
        acc = MicrobatchAccumulator(model, terms=INVARIANT)
        run(acc, model, split[dist.get_rank()], INVARIANT)
        acc.finish()
        acc.close()
        wrong = {how: max_error(truth(split, INVARIANT, how), want) for how in ("per_microbatch", "per_rank")}
        fuzzed.append((split, max_error(grads_of(model), want), wrong))
    out["fuzz"] = fuzzed
    return out


def three_world() -> dict[str, Any]:
    """3 ranks: rank 1 runs none, only rank 2 runs the value term (a term seen on one rank only)."""
    split: Split = [[[0, 1, 2], [3, 4]], [], [[5, 6], [7], [8, 9]]]
    model, rank = Model(), dist.get_rank()
    acc = MicrobatchAccumulator(model, terms=TERMS)
    run(acc, model, split[rank], TERMS if rank == 2 else INVARIANT)
    ledger = acc.finish()
    acc.close()
    want = Model()  # the value term: rank 2's 3 microbatches, each counting 1
    value = sum(term_losses(want, rows)["value"][0] for rows in split[2]) / 3
    (window_loss(want, split, INVARIANT) + value).backward()  # type: ignore[no-untyped-call]
    return {"error": max_error(grads_of(model), grads_of(want)),
            "terms": ledger.terms, "terms_local": ledger.terms_local}


# --- refusals: each case returns (error class, message) or None on every rank ---------------------------------------


def _case(body: Callable[[MicrobatchAccumulator, Model], object], terms: tuple[str, ...] = INVARIANT,
          **options: Any) -> tuple[str, str] | None:
    model, made = Model(), []
    refused = error_of(lambda: made.append(MicrobatchAccumulator(model, terms=terms, **options)))
    if refused is not None:
        return refused
    acc = made[0]
    try:
        return error_of(lambda: body(acc, model))
    finally:
        acc.discard()
        acc.close()


def _plain_backward(acc: MicrobatchAccumulator, model: Model) -> None:
    with acc.microbatch() as mb:
        mb.backward("policy", *term_losses(model, [0, 1])["policy"])
    with acc.microbatch():
        if dist.get_rank() == 0:
            term_losses(model, [2])["policy"][0].backward()  # type: ignore[no-untyped-call]
    acc.finish()


def _forgotten_count(acc: MicrobatchAccumulator, model: Model) -> None:
    with acc.microbatch() as mb:
        parts = term_losses(model, [dist.get_rank()])
        mb.backward("policy", *parts["policy"], retain_graph=True)
        mb.backward("nll", parts["nll"][0])  # its count never given
    acc.finish()


def _zero_count_zero_grad(acc: MicrobatchAccumulator, model: Model) -> Any:
    with acc.microbatch() as mb:
        parts = term_losses(model, [dist.get_rank()])
        mb.backward("policy", *parts["policy"], retain_graph=True)
        mb.backward("nll", 0 * parts["nll"][0], count=0)  # no token survived anywhere: contributes nothing
    return acc.finish().terms


def _zero_count_one_rank(acc: MicrobatchAccumulator, model: Model) -> None:
    with acc.microbatch() as mb:
        parts = term_losses(model, [dist.get_rank()])
        mb.backward("policy", *parts["policy"], retain_graph=True)
        if dist.get_rank() == 0:  # counted 0 everywhere, run on rank 0 only: rank 1 holds no sum of it
            mb.backward("nll", 0 * parts["nll"][0], count=0)
    acc.finish()


def refusals_world() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {
        "plain_backward": _case(_plain_backward),
        "forgotten_count": _case(_forgotten_count),
        "names_differ": _case(lambda a, m: None, ("policy", "kl") if rank == 0 else ("policy", "nll")),
        "weight": _case(_weighted),
        "divisors": _case(lambda a, m: a.divisors({"policy": 1})),
        "unknown_term": _case(lambda a, m: _one(a, m, "polcy")),
        "negative_count": _case(lambda a, m: _one(a, m, "policy", -2 if rank == 1 else 5)),
        "nonfinite": _case(lambda a, m: _one(a, m, "policy", 5, float("nan") if rank == 0 else 1.0),
                           nonfinite="raise"),
        "hand_set": _case(_hand_set),
    }
    out["zero_count_one_rank"] = _case(_zero_count_one_rank)
    holder: list[Any] = []
    out["zero_count_zero_grad"] = _case(lambda a, m: holder.append(_zero_count_zero_grad(a, m)))
    out["zero_count_terms"] = holder[0] if holder else None
    return out


def _one(acc: MicrobatchAccumulator, model: Model, term: str, count: object = 5, scale: float = 1.0) -> None:
    with acc.microbatch() as mb:
        mb.backward(term, scale * term_losses(model, [0])["policy"][0], count=count)
    acc.finish()


def _weighted(acc: MicrobatchAccumulator, model: Model) -> None:
    with acc.microbatch(weight=3) as mb:
        mb.backward("policy", term_losses(model, [0])["policy"][0], count=3)
    acc.finish()


def _hand_set(acc: MicrobatchAccumulator, model: Model) -> None:
    with acc.microbatch() as mb:
        mb.backward("policy", *term_losses(model, [0])["policy"])
        if dist.get_rank() == 1:
            model.v.bias.grad = torch.ones_like(model.v.bias)
    acc.finish()


def fsdp_world() -> dict[str, Any]:
    """FSDP2 on 2 ranks (the trunk and the root sharded): the window form on the uneven split, every term, against
    the truth; the shards form (the default) refused at construction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    model = Model()
    fully_shard(model.trunk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acc = MicrobatchAccumulator(model, fsdp="window", terms=TERMS)
    for split_name, split in (("uneven", UNEVEN), ("zero", ZERO)):
        run(acc, model, split[dist.get_rank()])
        ledger = acc.finish()
        got = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
        out[split_name] = (max_error(got, truth(split)), ledger.terms)  # type: ignore[arg-type]
        for p in model.parameters():
            p.grad = None
    acc.close()
    out["shards"] = error_of(lambda: MicrobatchAccumulator(model, terms=TERMS))
    return out
