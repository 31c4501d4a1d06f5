"""The :class:`PipelineAccumulator`: a ``torch.distributed.pipelining`` step with a counted token divisor."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import torch

from gradagg.errors import CollectiveError, GradaggError, PlacementError, WindowError
from gradagg.torch.accumulate.counting import divisor_problem
from gradagg.torch.accumulate.ledger import Span
from gradagg.torch.accumulate.lifetime import group_ranks
from gradagg.torch.accumulate.stale import clear_zeroed
from gradagg.torch.collectives import Group, check_launcher_world, check_same_on_all_ranks, get_rank
from gradagg.torch.norm import clip_grad_norm_, grad_norm
from gradagg.torch.pipeline import failures, waits
from gradagg.torch.pipeline.agreement import check_schedule
from gradagg.torch.pipeline.counts import Counts, Totals, local_tokens, reduce_counts
from gradagg.torch.pipeline.grads import reduce_and_divide
from gradagg.torch.pipeline.ledger import PipelineLedger
from gradagg.torch.pipeline.ties import Ties
from gradagg.torch.placements import is_dtensor

CountedLoss = Callable[..., tuple[torch.Tensor, "torch.Tensor | float"]]


class PipelineAccumulator:
    """Makes a pipelined step's gradients the sum over every microbatch of every replica / D, D counted once.

    Args:
        stages: the ``PipelineStage`` (or the list of them, interleaved) this rank runs.
        dp_group: the data-parallel group of this rank's stages (the ranks holding the same stages); None
            is the default group, right only with a single stage. Use a group of one without data parallelism.
        pp_group: this pipeline's group; None: the stages' own ``group``.
        tied: name -> tensor for the weights this rank holds that are tied to a tensor on another stage
            (``{"embedding": emb.weight}`` on the first stage, ``{"embedding": head.weight}`` on the last).

    Raises:
        GradaggError: ``WORLD_SIZE`` > 1 in the environment but no process group; a tie declared on one rank
            only, or with different shapes (every rank of the pipeline).
        PlacementError: a DTensor parameter (tensor parallelism inside a stage is not covered).
        CollectiveError: the replicas of a stage hold different parameters or ties.

    One step: ``schedule = ScheduleGPipe(stage, n, loss_fn=pipe.loss(fn))``, then
    ``ledger = pipe.step(schedule, inputs, target=labels)``, then ``pipe.clip_grad_norm_(1.0)`` and the optimizer.
    The test suite runs it on 4 gloo ranks; starting processes is not for a doctest::

    >>> pipe = PipelineAccumulator(stage, dp_group=dp, tied={"embedding": stage.submod.embed.weight})  # doctest: +SKIP
    """

    def __init__(self, stages: Any, *, dp_group: Group, pp_group: Group = None,
                 tied: Mapping[str, torch.Tensor] | None = None) -> None:
        check_launcher_world("PipelineAccumulator")
        self.stages = list(stages) if isinstance(stages, Sequence) else [stages]
        self.dp_group = dp_group
        self.pp_group = pp_group if pp_group is not None else self.stages[0].group
        self.last = any(s.is_last for s in self.stages)
        self.names, self.params = _parameters(self.stages)
        self.ties = Ties(_check_ties(tied or {}, self.params), self.pp_group)
        entries: list[tuple[object, str]] = [
            (n, f"(shape={tuple(p.shape)}, dtype={p.dtype})") for n, p in zip(self.names, self.params)
        ]
        entries += [(f"tie {n}", "declared") for n in self.ties.local]
        check_same_on_all_ranks(entries,
                                "the parameters of a stage's replicas", self.dp_group)
        self._counts = Counts()
        # the schedule's point-to-point waits are bounded by the collective timeout (see pipeline/waits.py)
        self.timeout = waits.step_timeout(self.pp_group, *(s.group for s in self.stages))

    def loss(self, fn: CountedLoss) -> Callable[..., torch.Tensor]:
        """The ``loss_fn`` to build the schedule with: ``fn(output, target)`` returns ``(loss sum, count)``.

        The loss must be a *sum* over the microbatch's tokens (not a mean), and the count the number of
        tokens it summed (0 for a padding microbatch whose labels are all ignored). The schedule
        back-propagates the sum; :meth:`step` divides by the total count. A call that raises, or returns a
        loss that is not one element with a gradient or a count that is not one number, is replaced by a zero
        loss (so every stage's sends and receives still complete) and :meth:`step` then raises on every rank.
        """

        def counted(output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
            try:
                loss_sum, count = fn(output, target, **kwargs)
                self._counts.record(loss_sum, count)
                return loss_sum
            except Exception as exc:  # noqa: BLE001 - any failure here: the schedule must still complete
                zero = failures.substitute(output)
                if zero is None:
                    raise failures.schedule_failure(exc, self.pp_group) from exc
                self._counts.record_failure(zero, failures.what_failed(exc))
                return zero  # the step raises on every rank once the schedule completed

        return counted

    def step(self, schedule: Any, *args: Any, **kwargs: Any) -> PipelineLedger:
        """Run ``schedule.step(*args, **kwargs)`` with its own scaling off, then reduce and divide.

        The schedule's ``scale_grads`` (a division by its number of microbatches) is turned off for the call
        and restored after. Then: the count is summed over the pipeline and the replicas (two small
        all_reduce calls), each stage's gradients are summed over its replicas and divided by that one D
        (one all_reduce per dtype), and tied weights are summed over the stages that hold them.

        Returns:
            The step's :class:`PipelineLedger`.

        Raises:
            WindowError: on every rank, with every gradient set to None, when some rank had non-zero gradients before
                the step (call ``optimizer.zero_grad()``), a count cannot count (NaN, Inf, negative, or a replica's
                counts sum beyond float64: named by its microbatch and rank, in the words ``MicrobatchAccumulator``
                refuses such a weight with), a pipeline has no last stage or no count (the schedule was not built
                with ``loss_fn=pipe.loss(fn)``), D = 0, beyond float64 or outside what a stage's gradients' dtype can be
                divided by (D beyond float32 with float32 gradients), or the loss function failed on some
                microbatch (naming it, the rank and the error), or the schedule itself raised on some rank (a
                stage's forward: its peer stages' point-to-point waits then fail, each bounded by the collective
                timeout, the shorter of the default group's and the pipeline group's,
                :mod:`gradagg.torch.pipeline.waits`; every rank then joins the count collectives, which carry it).
                Where a peer's process ended, a rank whose schedule failed raises its own WindowError.
            CollectiveError: before anything runs, on every rank of the pipeline, when its stages disagree on the
                schedule class, ``n_microbatches`` or the stages (one small all_gather_object per step); a
                collective failed or timed out.
        """
        # gradients zeroed in place (zero_grad(set_to_none=False)) are absent; any other is reported after the
        # step, on every rank
        check_schedule(schedule, self.stages, self.pp_group)
        stale = clear_zeroed(list(zip(self.names, self.params))) is not None
        self._counts.clear()
        losses = kwargs.pop("losses", None)
        losses = [] if losses is None else losses  # the schedule fills it: the real microbatches' losses
        scale = schedule.scale_grads
        schedule.scale_grads = False
        try:
            with waits.bounded(self.timeout):
                schedule.step(*args, losses=losses, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure inside the schedule is told to every rank
            self._told(exc, stale)
        finally:
            schedule.scale_grads = scale
        self._counts.keep(losses)
        return self._finish(stale)

    def _told(self, exc: Exception, stale: bool) -> NoReturn:
        """The schedule raised here (a stage's forward, a loss with nothing to stand in for it, a point-to-point
        wait that failed or timed out). This rank still joins the step's collectives over the data-parallel group,
        carrying the failure, so that the other replicas, whose steps may have completed, raise a WindowError
        naming it instead of waiting for this replica. Not those over the pipeline group: gloo closes a pair whose
        receive timed out, and this rank's pipeline peers learn of the failure from their own (bounded) waits.
        Where a collective fails there too (a peer's process ended), this rank's own error is raised."""
        self._drop()
        own = exc if isinstance(exc, GradaggError) else failures.schedule_failure(exc, self.pp_group)
        self._counts.clear()
        self._counts.failed = [failures.schedule_text(exc)]
        try:
            self._finish(stale, pipeline=False)
        except CollectiveError:
            raise own from exc
        raise own from exc  # not reached: _finish raises where a rank failed

    def _drop(self) -> None:
        for p in self.params:
            p.grad = None

    def _finish(self, stale: bool, pipeline: bool = True) -> PipelineLedger:
        present = [p.grad is not None for p in self.params]
        dtypes = {p.dtype for p, here in zip(self.params, present) if here}
        totals = reduce_counts(self._counts, self.last, stale, present, dtypes, self.pp_group, self.dp_group,
                               pipeline)
        problem = _problem(totals)
        if any(totals.failed) or any(totals.invalid):  # the same on every rank: each names what it could not count
            problem = "; ".join(failures.texts(self._counts.problems(), self.pp_group, self.dp_group, pipeline))
        if problem is not None:
            self._drop()
            raise WindowError(f"rank {get_rank()}: {problem}; every rank raises, and every gradient is now None")
        reduce_and_divide(self.params, totals.present, totals.divisor, self.dp_group)
        self.ties.reduce()
        return self._ledger(totals)

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm over every stage and replica, each element once, tied weights once."""
        return grad_norm(self.params, group=None, replica_group=self.dp_group, copies=self.ties.copies())

    def clip_grad_norm_(self, max_norm: float, *, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip with :meth:`grad_norm` (as :func:`gradagg.torch.clip_grad_norm_`); returns the norm before."""
        return clip_grad_norm_(self.params, max_norm, group=None, replica_group=self.dp_group,
                               copies=self.ties.copies(), error_if_nonfinite=error_if_nonfinite)

    def _ledger(self, totals: Totals) -> PipelineLedger:
        """The Ledger's fields with the replicas for ranks (see :class:`PipelineLedger`), and the pipeline's own."""
        dp = get_rank(self.dp_group)
        return PipelineLedger(
            rank=dp, world_size=len(totals.tokens), microbatches_local=totals.microbatches[dp],
            microbatches_global=sum(totals.microbatches), microbatches_per_rank=totals.microbatches,
            divisor=totals.divisor, weight_local=totals.tokens[dp], weight_per_rank=totals.tokens,
            weight_global=totals.divisor, span=Span(ranks=tuple(sorted(group_ranks(self.dp_group)))),
            pp_rank=get_rank(self.pp_group), stages=tuple(s.stage_index for s in self.stages), last=self.last,
            tokens_local=local_tokens(self._counts, self.last), padding_per_replica=totals.padding,
            loss=totals.loss / totals.divisor,
            absent=tuple(n for n, here in zip(self.names, totals.present) if not here), tied=tuple(self.ties.names),
        )


def _parameters(stages: list[Any]) -> tuple[list[str], list[torch.Tensor]]:
    """Every trainable parameter of this rank's stages, once each, named ``stage{i}.{name}``."""
    names, params, seen = [], [], set()
    for stage in stages:
        for name, p in stage.submod.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            if is_dtensor(p):
                raise PlacementError(f"stage {stage.stage_index}: parameter {name!r} is a DTensor; "
                                     "PipelineAccumulator covers plain (replicated) stage parameters only")
            seen.add(id(p))
            names.append(f"stage{stage.stage_index}.{name}")
            params.append(p)
    return names, params


def _check_ties(tied: Mapping[str, torch.Tensor], params: list[torch.Tensor]) -> Mapping[str, torch.Tensor]:
    ids = {id(p) for p in params}
    for name, t in tied.items():
        if id(t) not in ids:
            raise GradaggError(f"tied weight {name!r} (shape {tuple(t.shape)}) is not a trainable parameter "
                               "of this rank's stages")
    return tied


def _problem(t: Totals) -> str | None:
    """Why the step cannot be divided, the same words on every rank (None: it can). A count that cannot count, or a
    failed loss function, is named by the rank where it happened, to every rank (:meth:`Counts.problems`)."""
    replicas = range(len(t.tokens))
    checks = [
        ([r for r in replicas if t.stale[r]], "had non-zero gradients before the step (call optimizer.zero_grad())"),
        ([r for r in replicas if t.lasts[r] != 1], "do not have exactly one last stage among the stages passed"),
        ([r for r in replicas if t.lasts[r] == 1 and t.microbatches[r] == 0],
         "recorded no count: build the schedule with loss_fn=pipe.loss(fn)"),
    ]
    for bad, what in checks:
        if bad:
            return f"data-parallel replica(s) {bad} {what}"
    if t.divisor == 0:
        return f"the total count D is 0 (microbatches per replica {list(t.microbatches)}, all padding)"
    if not math.isfinite(t.divisor):  # each replica's count is finite (weight_problem): their sum is not
        return f"the total count D over the replicas sums beyond float64 (per replica {list(t.tokens)})"
    for dtype in t.dtypes:  # each gradient is divided by D in its own dtype
        problem = divisor_problem(t.divisor, dtype)
        if problem is not None:
            return f"the total count D, {t.divisor!r}, {problem} (per replica {list(t.tokens)})"
    return None
