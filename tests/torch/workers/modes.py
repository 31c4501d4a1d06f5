"""Windows of RL-like sequences for the aggregation modes, their float64 one-process truth, and rank workers.

A window is a list of whole sequences (features, targets, a mask with a fully masked sequence and uneven
lengths, a prompt group each). :func:`share` cuts it into pieces (``split``: some sequences cut in two, the
pieces landing in other microbatches or on other ranks), spreads them over every rank's microbatches
(uneven counts, zero included) and lays each microbatch out as padded rows, a packed row with
``cu_seqlens`` or a packed row with ``position_ids``. Every rank builds the same window from the seed and
takes its own microbatches. The token loss is ``(w . x_t - y_t)^2`` of a float64 linear model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg import modes_reference as ref
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.modes import Layout, Mode, aggregate, plan_window

D = 3  # feature width
NORM = 8.0  # C of seq-mean-token-sum-norm (a maximum completion length)
STYLES = ("rows", "cu_seqlens", "position_ids")


@dataclass(frozen=True)
class Sequence:
    sid: int
    group: int
    x: torch.Tensor  # (n, D) float64
    y: torch.Tensor  # (n,)
    mask: torch.Tensor  # (n,) bool


@dataclass(frozen=True)
class Micro:
    """One microbatch: its layout (what plan_window needs), features and targets of the layout's shape."""

    layout: Layout
    x: torch.Tensor
    y: torch.Tensor


def make_window(seed: int, n_seqs: int = 12, n_groups: int = 4) -> list[Sequence]:
    """Uneven lengths 1..7, about 70% of tokens valid, sequence 1 fully masked, random groups."""
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    seqs = []
    for s in range(n_seqs):
        n = rnd.randint(1, 7)
        mask = torch.tensor([rnd.random() < 0.7 for _ in range(n)]) if s != 1 else torch.zeros(n, dtype=torch.bool)
        if s != 1 and not bool(mask.any()):
            mask[0] = True
        x = torch.randn(n, D, generator=gen, dtype=torch.float64)
        seqs.append(Sequence(s, rnd.randrange(n_groups), x, torch.randn(n, generator=gen, dtype=torch.float64), mask))
    return seqs


def model() -> nn.Linear:
    torch.manual_seed(0)  # the same weights on every rank and in the truth
    return nn.Linear(D, 1, bias=False, dtype=torch.float64)


def token_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (m(x).squeeze(-1) - y) ** 2


def truth(mode: Mode, seqs: list[Sequence]) -> tuple[float, torch.Tensor, float]:
    """The mode over the whole window in one float64 process: (value, gradient of w, the reference's value)."""
    m = model()
    losses = [token_loss(m, s.x, s.y) for s in seqs]
    value = _formula(mode, seqs, losses)
    value.backward()
    oracle = ref.aggregate(
        mode.value,
        [ref.Seq(loss.tolist(), s.mask.tolist(), s.group) for s, loss in zip(seqs, losses)],
        norm=NORM,
    )
    assert m.weight.grad is not None
    return float(value.detach()), m.weight.grad.clone(), oracle


def _formula(mode: Mode, seqs: list[Sequence], losses: list[torch.Tensor]) -> torch.Tensor:
    """Each mode written out over the full batch, independently of gradagg.torch.modes."""
    full = [(s, loss[s.mask]) for s, loss in zip(seqs, losses) if bool(s.mask.any())]
    total = sum(v.sum() for _, v in full)
    if mode == Mode.TOKEN_MEAN:
        return total / sum(len(v) for _, v in full)  # type: ignore[return-value]
    if mode == Mode.SEQ_MEAN_TOKEN_MEAN:
        return sum(v.mean() for _, v in full) / len(full)  # type: ignore[return-value]
    if mode == Mode.SEQ_MEAN_TOKEN_SUM:
        return total / len(full)  # type: ignore[return-value]
    if mode == Mode.SEQ_MEAN_TOKEN_SUM_NORM:
        return total / (len(full) * NORM)  # type: ignore[return-value]
    groups: dict[int, list[torch.Tensor]] = {}
    for s, v in full:
        groups.setdefault(s.group, []).append(v)
    return sum(torch.cat(g).mean() for g in groups.values()) / len(groups)  # type: ignore[return-value]


def share(seqs: list[Sequence], counts: list[int], seed: int, split: bool) -> list[list[Micro]]:
    """Every rank's microbatches: pieces shuffled over sum(counts) microbatches, each laid out in a random style."""
    rnd = random.Random(seed + 1)
    pieces = []
    for s in seqs:
        cut = rnd.randint(1, len(s.mask) - 1) if split and len(s.mask) > 1 and rnd.random() < 0.6 else len(s.mask)
        pieces += [(s, 0, cut)] + ([(s, cut, len(s.mask))] if cut < len(s.mask) else [])
    rnd.shuffle(pieces)
    total = sum(counts)
    slots: list[list[tuple[Sequence, int, int]]] = [[] for _ in range(total)]
    for i, p in enumerate(pieces):
        slots[i % total if i < total else rnd.randrange(total)].append(p)
    micros = [_lay_out(slot, STYLES[rnd.randrange(3)]) for slot in slots]
    starts = [sum(counts[:r]) for r in range(len(counts))]
    return [micros[a : a + c] for a, c in zip(starts, counts)]


def _lay_out(pieces: list[tuple[Sequence, int, int]], style: str) -> Micro:
    xs = [s.x[a:b] for s, a, b in pieces]
    ys = [s.y[a:b] for s, a, b in pieces]
    ms = [s.mask[a:b] for s, a, b in pieces]
    ids = {"seq_ids": [s.sid for s, _, _ in pieces], "group_ids": [s.group for s, _, _ in pieces]}
    if style == "rows":  # padded rows; the padding's loss is finite but never read
        width = max(len(m) for m in ms)
        pad = [width - len(m) for m in ms]
        x = torch.stack([torch.cat([v, torch.ones(p, D, dtype=v.dtype)]) for v, p in zip(xs, pad)])
        y = torch.stack([torch.cat([v, torch.full((p,), 5.0, dtype=v.dtype)]) for v, p in zip(ys, pad)])
        mask = torch.stack([torch.cat([v, torch.zeros(p, dtype=torch.bool)]) for v, p in zip(ms, pad)])
        return Micro(Layout(mask.int(), **ids), x, y)
    x, y, mask = torch.cat(xs), torch.cat(ys), torch.cat(ms)
    if style == "cu_seqlens":
        cu = torch.tensor([0] + [sum(len(m) for m in ms[: i + 1]) for i in range(len(ms))])
        return Micro(Layout(mask, cu_seqlens=cu, **ids), x, y)
    pos = torch.cat([torch.arange(len(m)) for m in ms]).unsqueeze(0)
    return Micro(Layout(mask.unsqueeze(0), position_ids=pos, **ids), x.unsqueeze(0), y.unsqueeze(0))


def whole(micro: Micro) -> Micro:
    """The microbatch without sequence ids: every sequence in it is whole (the as-you-go path)."""
    lay = micro.layout
    return Micro(Layout(lay.mask, lay.position_ids, lay.cu_seqlens, None, lay.group_ids), micro.x, micro.y)


def run_window(mode: Mode, module: nn.Module, mine: list[Micro], planned: bool) -> dict[str, Any]:
    """One window on this rank through MicrobatchAccumulator: the mode's parts, weights, finish()."""
    acc = MicrobatchAccumulator(module)
    plan = plan_window(mode, [m.layout for m in mine], norm=_norm(mode)) if planned else None
    for k, mb in enumerate(acc.microbatches(mine)):
        lay = mb.layout
        loss = token_loss(module, mb.x, mb.y)
        if plan is not None:
            part = aggregate(mode, loss, lay.mask, plan=plan, microbatch=k)
        else:
            part = aggregate(
                mode, loss, lay.mask, position_ids=lay.position_ids, cu_seqlens=lay.cu_seqlens, norm=_norm(mode)
            )
        with acc.microbatch(weight=part.weight):
            part.loss.backward()
    ledger = acc.finish()
    if plan is not None:
        plan.check(ledger)
    acc.close()
    grad = next(p.grad for p in module.parameters())
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return {"divisor": ledger.divisor, "grad": grad.detach().clone()}


def _norm(mode: Mode) -> float | None:
    return NORM if mode == Mode.SEQ_MEAN_TOKEN_SUM_NORM else None


def wrap(kind: str) -> nn.Module:
    m = model()
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(m)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(m, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return m


def modes_world(seed: int, counts: list[int], kinds: list[str]) -> dict[str, Any]:
    """Every mode x path (as you go: whole sequences; planned: sequences split across microbatches and ranks)
    x wrapper: the gradient's relative error against the float64 truth, and the divisor."""
    rank, out = dist.get_rank(), {}
    seqs = make_window(seed)
    for split in (False, True):
        mine = share(seqs, counts, seed, split)[rank]
        for mode in Mode:
            want = truth(mode, seqs)[1]
            for kind in kinds:
                planned = split or mode == Mode.GROUP_TOKEN_MEAN
                got = run_window(mode, wrap(kind), mine if split else [whole(m) for m in mine], planned)
                err = float((got["grad"] - want).abs().max() / want.abs().max())
                out[f"{mode.value} {'split' if split else 'whole'} {kind}"] = (err, got["divisor"])
    return out


def refusals_world() -> dict[str, Any]:
    """plan_window given bad input on one rank only, or ranks that disagree: (error class, message) per rank."""
    from tests.torch.workers.dist import error_of

    rank, ok = dist.get_rank(), Layout(torch.ones(1, 2), seq_ids=[0], group_ids=[0])
    bad_ids = [Layout(torch.ones(2, 2), seq_ids=[1])] if rank == 1 else [ok]
    other_group = [Layout(torch.ones(1, 2), seq_ids=[0], group_ids=[rank])]  # sequence 0 in group 0 and group 1
    return {
        "bad ids on rank 1": error_of(lambda: plan_window("token-mean", bad_ids)),
        "a sequence in two groups": error_of(lambda: plan_window("group-token-mean", other_group)),
        "another mode on rank 1": error_of(
            lambda: plan_window("token-mean" if rank == 0 else "seq-mean-token-sum", [ok])
        ),
        "nothing valid anywhere": error_of(lambda: plan_window("token-mean", [Layout(torch.zeros(1, 2))] * rank)),
    }
