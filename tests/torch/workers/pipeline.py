"""The pipelined steps of tests/torch/test_pipeline.py, on 4 gloo ranks: 2 stages x 2 data-parallel replicas.

Rank ``2 * d + p`` is pipeline rank p of replica d: pipelines {0, 1} and {2, 3}, data-parallel groups {0, 2}
and {1, 3}. Interleaved runs put stages p and p + 2 (of 4) on pipeline rank p. Each case returns plain
numbers (errors against the one-process oracle of tests.torch.workers.pipe_model, ledgers, norms).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from gradagg.errors import WindowError
from gradagg.torch import PipelineAccumulator, count_collectives, grad_norm
from tests.torch.workers import pipe_model as m

Layout = list[list[list[int]]]  # per replica, per microbatch, the length of each sequence
UNEVEN: Layout = [[[6, 2], [3, 3], [6, 6], [1, 4]], [[2, 2], [6, 5], [4, 1], [3, 6]]]
PADDED: Layout = [UNEVEN[0], [[2, 2], [6, 5], [0, 0], [1, 0]]]  # replica 1: two microbatches count 0
FEWER: Layout = [UNEVEN[0], UNEVEN[1][:2]]  # replica 1 runs a schedule of 2 microbatches, replica 0 of 4
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class Rank:
    """This rank's place in the 2 x 2 mesh and its two groups (every rank creates every group, in order)."""

    def __init__(self) -> None:
        r = dist.get_rank()
        self.pp, self.dp = r % 2, r // 2
        pps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        self.pp_group, self.dp_group = pps[self.dp], dps[self.pp]


def batches(layout: Layout, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [m.microbatch(lengths, seed=100 * replica + k) for k, lengths in enumerate(layout[replica])]


def build(me: Rank, per_rank: int) -> tuple[list[PipelineStage], list[torch.nn.Module], dict[str, torch.Tensor]]:
    """This rank's stages, their modules, and its tied weights (the embedding on stage 0, the head last)."""
    n = 2 * per_rank
    whole = m.Whole()
    indices = [me.pp + 2 * k for k in range(per_rank)]
    modules = [m.stage_module(whole, i, n) for i in indices]
    stages = [PipelineStage(mod, i, n, torch.device("cpu"), group=me.pp_group) for mod, i in zip(modules, indices)]
    tied = {}
    for i, mod in zip(indices, modules):
        if i == 0:
            tied["embedding"] = mod.embed.weight
        if i == n - 1:
            tied["embedding"] = mod.head
    return stages, modules, tied


def step_inputs(stages: list[PipelineStage], mbs: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args = (torch.cat([b[0] for b in mbs]),) if any(s.is_first for s in stages) else ()
    kwargs = {"target": torch.cat([b[1] for b in mbs])} if any(s.is_last for s in stages) else {}
    return args, kwargs


def schedule(kind: str, stages: list[PipelineStage], n: int, loss: Any, scale: bool = True) -> Any:
    target = stages if kind == "interleaved" else stages[0]
    return SCHEDULES[kind](target, n_microbatches=n, loss_fn=loss, scale_grads=scale)


def error(stages: list[PipelineStage], modules: list[torch.nn.Module], want: dict[str, torch.Tensor]) -> float:
    """max over parameters of max |got - want| / max |want|; inf if absent and present disagree."""
    worst = 0.0
    for s, mod in zip(stages, modules):
        for name, p in mod.named_parameters():
            w = want.get(m.whole_names(s.stage_index, s.num_stages, name))
            if (p.grad is None) != (w is None):
                return float("inf")
            if w is not None:
                worst = max(worst, float((p.grad - w).abs().max() / w.abs().max()))
    return worst


def exact_case(me: Rank, kind: str, layout: Layout) -> dict[str, Any]:
    """gradagg's step against the float64 one-process token mean of every replica's microbatches."""
    stages, modules, tied = build(me, 2 if kind == "interleaved" else 1)
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    mbs = batches(layout, me.dp)
    sched = schedule(kind, stages, len(mbs), pipe.loss(m.token_sum_loss))  # scale_grads=True: step turns it off
    args, kwargs = step_inputs(stages, mbs)
    with count_collectives() as calls:
        ledger = pipe.step(sched, *args, **kwargs)
    want, norm = m.truth(batches(layout, 0) + batches(layout, 1))
    out = {"error": error(stages, modules, want), "ledger": ledger, "scale_restored": sched.scale_grads,
           "collectives": dict(calls.by_op)}
    if kind == "gpipe" and layout is UNEVEN:
        out.update(norms(me, pipe, stages, modules, want, norm))
    return out


def norms(me: Rank, pipe: PipelineAccumulator, stages: list[PipelineStage], modules: list[torch.nn.Module],
          want: dict[str, torch.Tensor], norm: float) -> dict[str, Any]:
    """The norm counted once, the naive one counting the tied weight on both stages, and a clip."""
    ours = pipe.grad_norm()
    naive = grad_norm(pipe.params, replica_group=me.dp_group)  # no copies declared: the tie counted twice
    tied = float(torch.linalg.vector_norm(want["embed.weight"]))
    coef = 0.5 * norm / (norm + 1e-6)
    before = pipe.clip_grad_norm_(0.5 * norm)
    clipped = error(stages, modules, {k: v * coef for k, v in want.items()})
    return {"norm": float(ours), "norm_truth": norm, "naive": float(naive), "tied_norm": tied,
            "clip_before": float(before), "clip_error": clipped}


def presence_case(me: Rank) -> dict[str, Any]:
    """``unused`` runs on replica 0's last stage only: present on one replica, absent on the other (zeros sent)."""
    stages, modules, tied = build(me, 1)
    if stages[0].is_last:
        modules[0].extra = me.dp == 0
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    mbs = batches(UNEVEN, me.dp)
    args, kwargs = step_inputs(stages, mbs)
    ledger = pipe.step(schedule("gpipe", stages, len(mbs), pipe.loss(m.token_sum_loss)), *args, **kwargs)
    want, _ = m.truth(batches(UNEVEN, 1), extra=batches(UNEVEN, 0))
    unused = [p.grad for n, p in modules[0].named_parameters() if n.startswith("unused.")]
    return {"error": error(stages, modules, want), "ledger": ledger,
            "unused_nonzero": bool(unused) and all(g is not None and bool(g.abs().sum() > 0) for g in unused)}


def zeroed_case(me: Rank) -> dict[str, Any]:
    """Every gradient allocated and exactly zero before the step (``zero_grad(set_to_none=False)``): absent."""
    stages, modules, tied = build(me, 1)
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    for p in pipe.params:
        p.grad = torch.zeros_like(p)
    mbs = batches(UNEVEN, me.dp)
    args, kwargs = step_inputs(stages, mbs)
    pipe.step(schedule("gpipe", stages, len(mbs), pipe.loss(m.token_sum_loss)), *args, **kwargs)
    want, _ = m.truth(batches(UNEVEN, 0) + batches(UNEVEN, 1))
    return {"error": error(stages, modules, want)}


def schedule_own_case(me: Rank) -> dict[str, Any]:
    """torch's own recipe: a token-mean loss per microbatch, scale_grads=True, then a DP mean; ties summed."""
    stages, modules, tied = build(me, 1)
    mbs = batches(UNEVEN, me.dp)
    args, kwargs = step_inputs(stages, mbs)
    schedule("gpipe", stages, len(mbs), m.token_mean_loss).step(*args, **kwargs)
    for p in (q for q in modules[0].parameters() if q.grad is not None):  # ``unused`` has none
        dist.all_reduce(p.grad, group=me.dp_group)
        p.grad.div_(2)
    dist.all_reduce(tied["embedding"].grad, group=me.pp_group)  # so only the weighting differs
    want, _ = m.truth(batches(UNEVEN, 0) + batches(UNEVEN, 1))
    return {"error": error(stages, modules, want)}


# Counts that cannot count, as replica 1's last stage returns them (microbatch k, its true count): the accumulator
# refuses the same weights with the same words (test_pipeline.py compares them). "beyond" and "float32" are replica
# 0's and 1's: each replica's total is finite, the two together leave float64; or stay in float64 but leave
# float32, the gradients' dtype (a float32 gradient divided by D would be 0).
BAD_COUNTS: dict[str, Callable[[int, Any], Any]] = {
    "nan": lambda k, count: float("nan"),
    "negative": lambda k, count: torch.tensor(-3) if k == 2 else count,
    "inf": lambda k, count: float("inf") if k == 1 else count,
    "overflow": lambda k, count: 1e308 if k < 2 else count,
    "beyond": lambda k, count: 1e308 if k == 0 else count,
    "float32": lambda k, count: 1e39 if k == 0 else count,
}


def refused_case(me: Rank, what: str) -> dict[str, Any]:
    """A step that must raise on every rank, leaving every gradient None."""
    stages, modules, tied = build(me, 1)
    if what == "float32":  # float32 gradients on every stage (the parameters converted in place)
        for mod in modules:
            mod.float()
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    layout = [[[0, 1]] * 2, [[1, 0]] * 2] if what == "zero" else UNEVEN
    mbs = batches(layout, me.dp)
    bad = BAD_COUNTS.get(what) if me.dp == 1 or what in ("beyond", "float32") else None

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
        total, count = m.token_sum_loss(logits, labels)
        k = next((k for k, b in enumerate(mbs) if torch.equal(labels, b[1])), None)  # None: shape inference
        return total, (count if bad is None or k is None else bad(k, count))

    if what == "stale" and dist.get_rank() == 3:
        next(iter(pipe.params)).grad = torch.ones_like(pipe.params[0])
    args, kwargs = step_inputs(stages, mbs)
    try:
        pipe.step(schedule("gpipe", stages, len(mbs), pipe.loss(loss)), *args, **kwargs)
    except WindowError as exc:
        return {"raised": str(exc), "all_none": all(p.grad is None for p in pipe.params)}
    return {"raised": None}


def forward_failure_case(me: Rank) -> dict[str, Any]:
    """Replica 0's stage 0 raises in its forward of microbatch 2 (no stand-in can replace it), its process living
    on: its peer stage's receive ends at the collective timeout, and replica 1, whose step completed, learns of it
    in the step's count all-reduce over the data-parallel groups. What each rank raised."""
    stages, _, tied = build(me, 1)
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    mbs = batches(UNEVEN, me.dp)

    def hook(_module: Any, args: tuple[Any, ...]) -> None:
        if me.dp == 0 and torch.equal(args[0], mbs[2][0]):
            raise ValueError("bad token ids")

    if stages[0].is_first:
        stages[0].submod.register_forward_pre_hook(hook)
    args, kwargs = step_inputs(stages, mbs)
    try:
        pipe.step(schedule("gpipe", stages, len(mbs), pipe.loss(m.token_sum_loss)), *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test asserts on the class: a raw error must show as one
        return {"raised": (type(exc).__name__, str(exc)), "all_none": all(p.grad is None for p in pipe.params)}
    return {"raised": None}


def world() -> dict[str, Any]:
    """Every case, in one world (starting a world costs more than the cases)."""
    me = Rank()
    out: dict[str, Any] = {}
    for kind in SCHEDULES:
        out[kind] = exact_case(me, kind, UNEVEN)
    out["padded"] = exact_case(me, "1f1b", PADDED)
    out["fewer"] = exact_case(me, "gpipe", FEWER)
    out["presence"] = presence_case(me)
    out["zeroed"] = zeroed_case(me)
    out["schedule_own"] = schedule_own_case(me)
    for what in ("stale", "zero", *BAD_COUNTS):
        out[f"refused_{what}"] = refused_case(me, what)
    alive = dist.new_group(list(range(4)), timeout=datetime.timedelta(seconds=600))  # longer than the deadline
    out["forward_failure"] = forward_failure_case(Rank())  # last, on groups of its own: a receive timed out there
    dist.barrier(group=alive)  # every process lives on until all four are done
    return out
