"""Pipelined steps that a hostile user writes (issue 22), on 2 gloo ranks: one pipeline of 2 stages, no replicas.

Rank p is pipeline rank p; each rank is its own data-parallel group of one. Interleaved schedules put stages
p and p + 2 (of 4) on rank p. Each case returns plain values: the error against the float64 one-process token
mean (tests.torch.workers.pipe_model), or ``(error class, message, seconds)`` of what the step raised.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from gradagg.errors import GradaggError
from gradagg.torch import PipelineAccumulator
from tests.torch.workers import pipe_model as m
from tests.torch.workers import pipeline as pw

# per microbatch, the lengths of its sequences: counts 6, 4, 10, 3 (D = 23)
LAYOUT: pw.Layout = [[[6, 2], [3, 3], [6, 6], [1, 4]]]
REUSED = {  # a count tensor the loss function allocates once and overwrites for every microbatch
    "float64": lambda: torch.zeros((), dtype=torch.float64),
    "float64 shape (1,)": lambda: torch.zeros(1, dtype=torch.float64),
    "float32": lambda: torch.zeros((), dtype=torch.float32),
    "int64": lambda: torch.zeros((), dtype=torch.int64),
    "float64 view": lambda: torch.zeros(3, dtype=torch.float64)[1],
}


class Pipe:
    """This rank's pipeline group (every rank) and its data-parallel group of one (every rank creates both)."""

    def __init__(self) -> None:
        self.pp = dist.get_rank()
        self.pp_group = dist.new_group([0, 1])
        self.dp_group = [dist.new_group([r]) for r in range(2)][self.pp]


def build(me: Pipe, kind: str) -> tuple[list[PipelineStage], list[torch.nn.Module], dict[str, torch.Tensor]]:
    return pw.build(me, 2 if kind == "interleaved" else 1)  # type: ignore[arg-type]


def reused_count_case(me: Pipe, kind: str, dtype: str) -> dict[str, Any]:
    """The loss returns its count in one tensor, overwritten in place for every microbatch: D = 23, exact."""
    stages, modules, tied = build(me, kind)
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    buf = REUSED[dtype]()

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total, count = m.token_sum_loss(logits, labels)
        buf.fill_(count)
        return total, buf

    mbs = pw.batches(LAYOUT, 0)
    args, kwargs = pw.step_inputs(stages, mbs)
    ledger = pipe.step(pw.schedule(kind, stages, len(mbs), pipe.loss(loss)), *args, **kwargs)
    want, _ = m.truth(mbs)
    return {"divisor": ledger.divisor, "local": ledger.tokens_local, "error": pw.error(stages, modules, want)}


def outcome(fn: Any) -> tuple[str, str, float] | None:
    """``(error class, message, seconds)`` of what ``fn()`` raised (any exception), or None."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the class: a raw error must show as one
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None


def mismatch_case(me: Pipe, kind: str, what: str) -> tuple[str, str, float] | None:
    """Rank 0 builds its schedule with 4 microbatches, rank 1 with 2 (``"n_microbatches"``), or rank 1 runs
    another schedule class (``"schedule"``)."""
    stages, _, tied = build(me, kind)
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    n = 2 if what == "n_microbatches" and me.pp == 1 else 4
    other = {"gpipe": "1f1b", "1f1b": "gpipe", "interleaved": "interleaved"}[kind]
    sched = pw.schedule(other if what == "schedule" and me.pp == 1 else kind, stages, n, pipe.loss(m.token_sum_loss))
    args, kwargs = pw.step_inputs(stages, pw.batches(LAYOUT, 0))
    return outcome(lambda: pipe.step(sched, *args, **kwargs))


FAILURES = {  # how the last stage's loss function fails on microbatch 2 (of 4)
    "raises": lambda total, count: (_ for _ in ()).throw(KeyError("no such label")),
    "non-scalar loss": lambda total, count: (total.expand(3), count),
    "non-scalar count": lambda total, count: (total, torch.stack([count, count])),
    "no gradient": lambda total, count: (total.detach(), count),
    "not a pair": lambda total, count: total,
}


def loss_failure_case(me: Pipe, kind: str, how: str) -> dict[str, Any]:
    """The last stage's loss function fails on microbatch 2 in way ``how``; then a good step on the same stages."""
    stages, modules, tied = build(me, kind)
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    mbs = pw.batches(LAYOUT, 0)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> Any:
        total, count = m.token_sum_loss(logits, labels)
        return FAILURES[how](total, count) if torch.equal(labels, mbs[2][1]) else (total, count)

    args, kwargs = pw.step_inputs(stages, mbs)
    failed = outcome(lambda: pipe.step(pw.schedule(kind, stages, len(mbs), pipe.loss(loss)), *args, **kwargs))
    all_none = all(p.grad is None for p in pipe.params)
    pipe.step(pw.schedule(kind, stages, len(mbs), pipe.loss(m.token_sum_loss)), *args, **kwargs)
    want, _ = m.truth(mbs)
    return {"failed": failed, "all_none": all_none, "after": pw.error(stages, modules, want)}


def mismatch_world(cases: list[tuple[str, str]]) -> dict[Any, Any]:
    me = Pipe()
    return {(kind, what): mismatch_case(me, kind, what) for kind, what in cases}


def failure_world(cases: list[tuple[str, str]]) -> dict[Any, Any]:
    me = Pipe()
    return {(kind, how): loss_failure_case(me, kind, how) for kind, how in cases}


def reused_world() -> dict[str, Any]:
    me = Pipe()
    return {(kind, dtype): reused_count_case(me, kind, dtype) for kind in pw.SCHEDULES for dtype in REUSED}


__all__ = ["GradaggError", "failure_world", "mismatch_world", "reused_world"]


def forward_failure_case(me: Pipe, kind: str) -> dict[str, Any]:
    """Stage 0's forward raises on microbatch 2 (its module, not the loss): no stand-in can replace it."""
    stages, _, tied = build(me, kind)
    pipe = PipelineAccumulator(stages, dp_group=me.dp_group, tied=tied)
    mbs = pw.batches(LAYOUT, 0)

    def hook(_module: Any, args: tuple[Any, ...]) -> None:
        if torch.equal(args[0], mbs[2][0]):
            raise ValueError("bad token ids")

    for s in stages:
        if s.stage_index == 0:
            s.submod.register_forward_pre_hook(hook)
    args, kwargs = pw.step_inputs(stages, mbs)
    out = {"failed": outcome(lambda: pipe.step(pw.schedule(kind, stages, len(mbs), pipe.loss(m.token_sum_loss)),
                                               *args, **kwargs))}
    out["all_none"] = all(p.grad is None for p in pipe.params)
    return out



def forward_failures_world(kind: str) -> dict[str, Any]:
    """Stage 0's forward raises on microbatch 2, twice, on fresh groups each time (a timed-out receive is not
    reused). ``"lives_on"``: rank 0's process lives on, waiting in a barrier of its own (a long timeout) until rank 1
    is done: rank 1 must raise on its own, within the collective timeout. ``"ends"``: rank 0's process ends at once
    after it (the world's last case), which breaks rank 1's receive."""
    import datetime

    me = Pipe()
    alive = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=600))  # longer than any world's deadline
    out = {"lives_on": forward_failure_case(me, kind)}
    dist.barrier(group=alive)
    out["ends"] = forward_failure_case(Pipe(), kind)
    out["timeouts"] = timeouts(me)
    return out


def timeouts(me: Pipe) -> dict[str, Any]:
    """What :mod:`gradagg.torch.pipeline.waits` reads: the default group's timeout, a ``new_group``'s (torch's
    default), the step's bound, and a group whose timeout cannot be read (None: the fallback)."""
    from gradagg.torch.pipeline import waits

    return {"world": waits.group_timeout(None), "pipeline": waits.group_timeout(me.pp_group),
            "step": waits.step_timeout(me.pp_group), "unreadable": waits.group_timeout(object())}
