"""One training run on every rank: each approach trains its own model copy, side by side, checked every step.

Every step, every rank computes alone the ground truth for each approach's current values (the gradient
of the whole global batch's loss), then the gradient that approach steps with; the error is their
largest difference, then the maximum over ranks. The demo's own plumbing (gathering what the ranks
computed for the wrong approaches, the maxima) calls ``torch.distributed`` directly; only gradagg's copy
goes through the library.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradagg.demo import data, results
from gradagg.demo.approaches import WRONG, GradaggRun, RankRows
from gradagg.demo.cases import Case, make
from gradagg.demo.models import HEAD, Params
from gradagg.demo.options import Config
from gradagg.demo.results import GRADAGG, CaseResult, Outcome, StepRecord
from gradagg.errors import CollectiveError

DOUBLE = torch.float64  # what travels: exact for every float32/float64 gradient and for whole counts below 2**53


def train(cfg: Config) -> Outcome:
    """Run every case of ``cfg`` on this rank (call it on every rank of the default process group).

    Args:
        cfg: the configuration, the same on every rank.

    Returns:
        This rank's records; the errors in them are maxima over ranks.

    Raises:
        CollectiveError: the group does not have ``cfg.world_size`` ranks.
    """
    rank = dist.get_rank()
    if dist.get_world_size() != cfg.world_size:
        raise CollectiveError(f"rank {rank}: the group has {dist.get_world_size()} ranks, expected {cfg.world_size}")
    return Outcome([train_case(make(name), cfg, rank) for name in cfg.cases], cfg.wrap, cfg.world_size)


@dataclass
class _State:
    """A wrong approach's model copy (plain leaves), and its stale replica of head_b's gradient on a non-owner."""

    params: Params
    stale: torch.Tensor | None = None


def train_case(case: Case, cfg: Config, rank: int) -> CaseResult:
    """Train one copy per approach of ``case`` for ``cfg.steps`` steps from the same start.

    Args:
        case: the case.
        cfg: the configuration.
        rank: this rank.

    Returns:
        The case's records on this rank.
    """
    start = time.perf_counter()
    values = case.start(cfg)
    run = case.gradagg(values, cfg, rank)
    wrong = [(a.name, _State({n: t.detach().clone().requires_grad_() for n, t in values.items()}))
             for a in case.approaches[1:]]
    held = case.held_out(cfg)
    records = []
    for step in range(cfg.steps):
        batch = case.batch(cfg, step)
        mine = data.mine(cfg, batch, rank)
        rec = StepRecord(step)
        _gradagg_step(case, run, batch, mine, held, rec)
        for name, st in wrong:
            _wrong_step(case, name, st, batch, mine, held, cfg, rank, rec)
        _max_over_ranks(rec, [a.name for a in case.approaches])
        records.append(rec)
    final = {GRADAGG: case.eval_loss(run.values(), held)} | {n: case.eval_loss(st.params, held) for n, st in wrong}
    run.close()
    return CaseResult(case.name, case.title, case.details(cfg), case.approaches, records, final, run.ledger,
                      time.perf_counter() - start)


def _gradagg_step(case: Case, run: GradaggRun, batch: list[object], mine: list[object], held: list[object],
                  rec: StepRecord) -> None:
    values = run.values()
    rec.loss[GRADAGG] = case.eval_loss(values, held)
    truth = case.truth(values, batch)
    grads = run.step(mine)
    rec.error[GRADAGG], rec.off[GRADAGG] = errors(grads, truth)
    rec.scale = max(float(t.abs().max()) for t in truth.values())  # what gradagg's error compares with
    run.update()


def _wrong_step(case: Case, name: str, st: _State, batch: list[object], mine: list[object], held: list[object],
                cfg: Config, rank: int, rec: StepRecord) -> None:
    rec.loss[name] = case.eval_loss(st.params, held)
    truth = case.truth(st.params, batch)
    ranks = gather(case.rows(st.params, mine, st.stale), st.params, cfg)
    grads = WRONG[name](ranks, st.params, cfg)
    rec.error[name], rec.off[name] = errors(grads, truth)
    st.stale = case.stale_after(grads, rank, cfg)
    with torch.no_grad():
        for n, t in st.params.items():
            t.sub_(case.lr * grads[n])


def errors(grads: Params, truth: Params) -> tuple[float, list[str]]:
    """The max |grad - truth| over every parameter, and the parameters beyond the tolerance.

    Args:
        grads: what an approach steps with.
        truth: the ground truth, same names.

    Returns:
        (the largest absolute difference, the names whose difference exceeds :data:`results.TOLERANCE`).

    >>> one, two, half = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([0.5])
    >>> errors({"a": one, "b": two}, {"a": one, "b": half})
    (1.5, ['b'])
    """
    diff = {n: float((grads[n] - truth[n]).abs().max()) for n in truth}
    return max(diff.values()), [n for n, e in diff.items() if e > results.TOLERANCE]


def _max_over_ranks(rec: StepRecord, names: list[str]) -> None:
    """Replace each error by its maximum over ranks, so that rank 0 reports every rank's worst."""
    errs = torch.tensor([rec.error[a] for a in names], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    rec.error = dict(zip(names, errs.tolist()))


# --- what the wrong approaches combine: every rank's rows, gathered -----------------------------


def gather(mine: RankRows, like: Params, cfg: Config) -> list[RankRows]:
    """Every rank's :class:`RankRows`, in rank order, on every rank: one tensor ``all_gather``.

    A tensor all_gather, not all_gather_object: pickling tensors costs more than the whole training.
    Ranks with fewer microbatches pad with zero rows (the counts are in ``cfg``, so nothing is inferred).

    Args:
        mine: this rank's rows.
        like: the parameters (names, shapes).
        cfg: the configuration (microbatches per rank).

    Returns:
        One :class:`RankRows` per rank.
    """
    flat = pack(mine, like, max(cfg.counts))
    flats = [torch.empty_like(flat) for _ in range(cfg.world_size)]
    dist.all_gather(flats, flat)
    return [unpack(f, like, count) for f, count in zip(flats, cfg.counts)]


def pack(rows: RankRows, like: Params, slots: int) -> torch.Tensor:
    """One flat float64 tensor: per microbatch slot ``gradients | present | tokens``; then ``stale | has stale``.

    >>> like = {"w": torch.zeros(2)}
    >>> pack(RankRows([{"w": torch.tensor([1.0, 2.0])}], [5]), like, 2).tolist()
    [1.0, 2.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0]
    """
    parts = []
    for i in range(slots):
        row = rows.grads[i] if i < len(rows.grads) else dict.fromkeys(like)
        for n, t in like.items():
            g = row[n]
            parts.append((torch.zeros_like(t) if g is None else g).reshape(-1).to(DOUBLE))
        present = [float(row[n] is not None) for n in like]
        tokens = float(rows.tokens[i]) if i < len(rows.tokens) else 0.0
        parts.append(torch.tensor([*present, tokens], dtype=DOUBLE))
    if HEAD in like:
        stale = torch.zeros_like(like[HEAD]) if rows.stale is None else rows.stale
        parts += [stale.reshape(-1).to(DOUBLE), torch.tensor([float(rows.stale is not None)], dtype=DOUBLE)]
    return torch.cat(parts)


def unpack(flat: torch.Tensor, like: Params, count: int) -> RankRows:
    """The inverse of :func:`pack` for a rank that ran ``count`` microbatches.

    >>> like = {"w": torch.zeros(2)}
    >>> back = unpack(pack(RankRows([{"w": None}], [5]), like, 2), like, 1)
    >>> back.grads, back.tokens
    ([{'w': None}], [5])
    """
    rows: list[dict[str, torch.Tensor | None]] = []
    tokens, pos = [], 0
    for _ in range(count):
        grads = {}
        for n, t in like.items():
            grads[n] = flat[pos : pos + t.numel()].view(t.shape).to(t.dtype)
            pos += t.numel()
        flags = [round(v) for v in flat[pos : pos + len(like) + 1].tolist()]  # whole numbers, exact in float64
        pos += len(like) + 1
        rows.append({n: g if flags[k] else None for k, (n, g) in enumerate(grads.items())})
        tokens.append(flags[-1])
    stale = None
    if HEAD in like:
        tail = flat[flat.numel() - like[HEAD].numel() - 1 :]
        stale = tail[:-1].view(like[HEAD].shape).to(like[HEAD].dtype) if tail[-1] else None
    return RankRows(rows, tokens, stale)
