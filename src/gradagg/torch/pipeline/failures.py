"""One stage's failure in a pipelined step, told to every rank of every pipeline.

Only the last stage runs the loss function. Were its exception to escape, the other stages would wait in
torch's point-to-point receives for the gradients that never come (a raw gloo error, or no error at all).
So the wrapped loss catches it, and returns in its place a zero loss over the stage's output (every
floating output tensor's sum times 0): the schedule then completes its sends and receives on every stage,
with zero gradients for that microbatch, and the step's count collective carries the failure. Every rank
then gathers what went wrong (two small ``all_gather_object`` calls, on this path only), sets every gradient
to None and raises the same error. A stage output without a floating tensor that has a gradient leaves
nothing to back-propagate: then the schedule raises there, as it does for a failure inside a stage's forward.
A rank whose schedule raised joins the step's collectives over the data-parallel group only (its pipeline group
may be broken), carrying :func:`schedule_text`, so that the other replicas raise too; its pipeline peers fail
in their point-to-point waits, bounded by the collective timeout (:mod:`.waits`), and do the same.
"""

from __future__ import annotations

import torch

from gradagg.errors import GradaggError, WindowError, first_line
from gradagg.torch.accumulate.wrappers.pad_run import zero_loss
from gradagg.torch.collectives import Group, all_gather_object, get_rank


def substitute(output: object) -> torch.Tensor | None:
    """A zero loss standing in for a failed loss function (see
    :func:`~gradagg.torch.accumulate.wrappers.pad_run.zero_loss`)."""
    return zero_loss(output)


def what_failed(exc: BaseException) -> str:
    return f"the loss function raised {type(exc).__name__}: {first_line(exc)}" if not isinstance(
        exc, GradaggError) else f"the loss function returned what cannot be counted: {first_line(exc)}"


def texts(mine: list[str], pp: Group, dp: Group, pipeline: bool = True) -> list[str]:
    """Every replica's failures, as ``"pipeline rank p (global rank g) of replica r: ..."``; every rank calls it.

    Gathered over the data-parallel group first, then the pipeline's; ``pipeline=False`` (a rank whose schedule
    raised: its pipeline group may be broken, gloo closing a pair whose receive timed out) gathers over the first
    only, pairing with the others' first gather, and knows its own replica's failures only."""
    here = [f"pipeline rank {get_rank(pp)} (global rank {get_rank()}) of data-parallel replica {get_rank(dp)}, "
            f"{m}" for m in mine]
    replicas = [t for got in all_gather_object(here, dp) for t in got]  # type: ignore[attr-defined]
    if not pipeline:
        return replicas
    return [t for got in all_gather_object(replicas, pp) for t in got]  # type: ignore[attr-defined]


def schedule_text(exc: BaseException) -> str:
    """What failed in the schedule here, for the step's collectives to carry (see :func:`schedule_failure`)."""
    if isinstance(exc, GradaggError):
        return first_line(exc)
    cause, seen = exc, {id(exc)}
    while cause.__cause__ is not None and id(cause.__cause__) not in seen:
        cause = cause.__cause__
        seen.add(id(cause))
    why = "" if cause is exc else f", caused by {type(cause).__name__}: {first_line(cause)}"
    return (f"the pipelined step raised {type(exc).__name__}: {first_line(exc)}{why} (a stage's forward or "
            "backward failed here, or a peer stage failed or left and this rank's point-to-point transfer with it "
            "broke or timed out)")


def schedule_failure(exc: BaseException, pp: Group) -> WindowError:
    """What a rank raises when the schedule itself raised here (a stage's forward, a point-to-point failure).

    torch wraps a stage's exception (``[Stage 0] failed to run forward``): the message names the first
    cause too. Only this rank knows: a peer stage waiting for this one's sends learns of it when this
    process ends (its point-to-point receive then fails, and becomes this same error there) or, if it lives on,
    when the collective timeout ends that receive (:mod:`.waits` bounds each of the step's waits).
    """
    return WindowError(
        f"pipeline rank {get_rank(pp)} (global rank {get_rank()}): {schedule_text(exc)}; the step's gradients are "
        "unusable: every gradient here is now None"
    )
