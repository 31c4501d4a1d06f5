"""One stage's failure in a pipelined step, told to every rank of every pipeline.

Only the last stage runs the loss function. Were its exception to escape, the other stages would wait in
torch's point-to-point receives for the gradients that never come (a raw gloo error, or no error at all).
So the wrapped loss catches it, and returns in its place a zero loss over the stage's output (every
floating output tensor's sum times 0): the schedule then completes its sends and receives on every stage,
with zero gradients for that microbatch, and the step's count collective carries the failure. Every rank
then gathers what went wrong (two small ``all_gather_object`` calls, on this path only), sets every gradient
to None and raises the same error. A stage output without a floating tensor that has a gradient leaves
nothing to back-propagate: then the failing rank raises at once (the best available; the others fail in
their receives, which :func:`schedule_failure` names).
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


def texts(mine: list[str], pp: Group, dp: Group) -> list[str]:
    """Every replica's failures, as ``"pipeline rank p (global rank g) of replica r: ..."``; every rank calls it."""
    here = [f"pipeline rank {get_rank(pp)} (global rank {get_rank()}) of data-parallel replica {get_rank(dp)}, "
            f"{m}" for m in mine]
    pipeline = [t for got in all_gather_object(here, pp) for t in got]  # type: ignore[attr-defined]
    return [t for got in all_gather_object(pipeline, dp) for t in got]  # type: ignore[attr-defined]


def schedule_failure(exc: BaseException, pp: Group) -> WindowError:
    """What a rank raises when the schedule itself raised here (a stage's forward, a point-to-point failure).

    torch wraps a stage's exception (``[Stage 0] failed to run forward``): the message names the first
    cause too. Only this rank knows: a peer stage waiting for this one's sends learns of it when this
    process ends (its point-to-point receive then fails, and becomes this same error there) or, if it lives on,
    when the collective timeout ends that receive (:mod:`.waits` bounds each of the step's waits).
    """
    cause, seen = exc, {id(exc)}
    while cause.__cause__ is not None and id(cause.__cause__) not in seen:
        cause = cause.__cause__
        seen.add(id(cause))
    why = "" if cause is exc else f", caused by {type(cause).__name__}: {first_line(cause)}"
    return WindowError(
        f"pipeline rank {get_rank(pp)} (global rank {get_rank()}): the pipelined step raised "
        f"{type(exc).__name__}: {first_line(exc)}{why} (a stage's forward or backward failed here, or a peer "
        "stage failed or left and this rank's point-to-point transfer with it broke); the step's gradients are "
        "unusable: every gradient here is now None"
    )
