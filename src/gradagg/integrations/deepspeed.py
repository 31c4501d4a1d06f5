"""Exact accumulation in a raw DeepSpeed ZeRO loop: ``acc = exact(engine)``.

DeepSpeed's own recipe back-propagates ``loss / gradient_accumulation_steps`` and averages over the ranks: the
mean of microbatch means, wrong when microbatches hold different token counts, divided by the configured steps
even in a short last window, and under ZeRO-2 and -3 it cannot run different microbatch counts per rank. With
the accumulator returned here a loop back-propagates each microbatch's *summed* loss::

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)  # the config as it is
    acc = exact(engine)
    for window in windows:                        # any number of microbatches per rank, zero included
        for batch in window:
            with acc.microbatch(weight=n_tokens(batch)):
                engine.backward(loss_sum(engine, batch))
        engine.step()                             # one optimizer step per window, on every rank

It is a :class:`~gradagg.torch.MicrobatchAccumulator` on the engine's module whose wrapper is DeepSpeed's
(:mod:`gradagg.torch.accumulate.wrappers.deepspeed`): the counting, the refusals and the :class:`Ledger` are the
accumulator's, and DeepSpeed reduces the gradients. What it does, and why:

* **the window** is what runs between two ``engine.step()`` calls: one ``engine.coalesce_grad_reduction()`` block
  (DeepSpeed's public context: every backward inside keeps its gradient local, and the block's exit issues one
  reduction), opened by the first microbatch or backward, or by ``engine.step()`` on a rank that ran none.
* **the divisor**: ``engine.step()`` runs ``finish()`` first: the counters' exchange (one small all-reduce, with
  each rank's status, so that a bad weight on one rank raises on every rank), then every local gradient is
  divided by ``D / world`` (zeros where a parameter has none) and the block exits: DeepSpeed's average, which
  its optimizer applies after its own clipping, is the sum over all microbatches divided by D, the total weight
  (M without weights), never ``gradient_accumulation_steps``. A refused window hands DeepSpeed zeros (its
  reduction still runs on every rank), is dropped, and no step is taken.
* **gradient_accumulation_steps** k stays in the config as users write it (``train_batch_size = micro x k x
  world`` is DeepSpeed's check): each ``engine.step()`` declares the boundary through DeepSpeed's public
  ``set_gradient_accumulation_boundary(True)``, so DeepSpeed steps its optimizer, and its learning-rate scheduler,
  exactly once per window, however many microbatches it held. DeepSpeed's own loop, ``engine.step()`` after every
  microbatch, would then step k times as often: with k > 1, a window in which every rank ran exactly one
  microbatch that counts (weight-0 padding does not) is refused at its ``engine.step()``, on every rank, naming
  why, until a window shows a rank with two or more (one small all-reduce per window until then; DeepSpeed's loop
  never has two); a window of one microbatch per rank is declared with
  ``engine.set_gradient_accumulation_boundary(True)`` before its ``engine.step()`` (for that window only).
  ``"auto"`` is the Hugging Face integration's to fill; DeepSpeed's ``initialize`` itself raises on it in a raw
  config.
* **gradient_allreduce_op**: DeepSpeed's reduction averages over the ranks by default, and each rank's sum is
  divided by ``D / world``; with ``"gradient_allreduce_op": "sum"`` (ZeRO-1 and -2) it sums them, and each rank's
  sum is divided by D. The engine's ``gradient_average`` says which; an engine without it is refused.
* **ZeRO-3** gathers parameters collectively in every forward: its ranks must run the same number of
  microbatches (a rank that ran out pads with ``acc.microbatch(weight=0)`` and ``engine.backward(0 * loss)``);
  unpadded, a collective times out (a ``CollectiveError`` on the rank waiting in the window's all-reduce).

``engine.step``, ``engine.backward`` and ``engine.set_gradient_accumulation_boundary`` are wrapped on the engine
instance (``close()`` restores them; the last records a declared boundary, for the window it ends): the backward
never divides by ``gradient_accumulation_steps`` (``scale_wrt_gas=False``), a backward outside a
microbatch poisons the window (``engine.step()`` then raises on every rank), and a step always steps. Under
Accelerate's DeepSpeed plugin, ``acc = gradagg.integrations.accelerate.exact(accelerator, engine, optimizer)`` (this
class on the engine ``accelerator.prepare`` returned), then ``with accelerator.accumulate(engine): with
acc.microbatch(weight=n): accelerator.backward(loss_sum)``: Accelerate calls ``engine.step()`` inside the backward of
its sync microbatch, which ends that microbatch and closes the window there; a Hugging Face ``Trainer`` with
``deepspeed=`` goes the same way under ``gradagg.integrations.transformers.exact(trainer)``.

* **bf16** (``"bf16": {"enabled": true}``): DeepSpeed's parameters, and so the ``.grad`` its block keeps local,
  are bf16; the wrapper adds each microbatch's gradient into a float32 sum of the window and rounds it to bf16 once,
  divided, for DeepSpeed's reduction (see :mod:`gradagg.torch.accumulate.wrappers.deepspeed`). A non-finite
  gradient on any rank reaches every rank through that reduction, and DeepSpeed's bf16 overflow check skips the
  step on every rank: ``acc.ledger`` is then a :class:`DeepSpeedLedger` with ``step_applied`` False. Refused at
  :func:`exact`, naming what works: fp16 (DeepSpeed's CPU accelerator has none, so its loss scaling under
  ``exact()`` is untested), bf16 with ``data_types.grad_accum_dtype`` other than bf16 (ZeRO-1 then runs DeepSpeed's
  ``BF16_Optimizer``, which has no ``coalesce_grad_reduction()``), bf16 with ``bf16.check_grad_overflow`` false.

Memory: inside the window every rank holds the full local gradient of every parameter (DeepSpeed's coalesced
reduction), where ZeRO-2 and -3 on their own reduce-scatter each microbatch and keep only their partition; in bf16
also the window's float32 sums.
DeepSpeed is imported by the caller; this module does not import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.accumulate import opening
from gradagg.torch.accumulate.ledger import Ledger
from gradagg.torch.accumulate.params import Params
from gradagg.torch.accumulate.seam import Choice, Choose, Wrapper
from gradagg.torch.accumulate.terms_after import Microbatch
from gradagg.torch.accumulate.window import weight_values
from gradagg.torch.accumulate.wrappers.deepspeed import DeepSpeedZero
from gradagg.torch.accumulate.wrappers.fsdp import Mode
from gradagg.torch.accumulate.wrappers.padding import Pad
from gradagg.torch.collectives import Group, all_reduce_sum, device_for, get_world_size


@dataclass(frozen=True)
class DeepSpeedLedger(Ledger):
    """A window's :class:`Ledger`, and whether DeepSpeed's ``engine.step()`` applied it.

    Attributes:
        step_applied: False where DeepSpeed skipped the step (its bf16 overflow check found a non-finite gradient
            after the reduction: it all-reduces that flag, so every rank skips, and the window is dropped); None
            before ``engine.step()`` or where the engine cannot say (no ``was_step_applied()``).
    """

    step_applied: bool | None = None

    @classmethod
    def after_step(cls, ledger: Ledger, engine: Any) -> DeepSpeedLedger:
        """``ledger`` with what DeepSpeed's public ``engine.was_step_applied()`` said after the step."""
        asked = getattr(engine, "was_step_applied", None)
        applied = bool(asked()) if callable(asked) else None
        return cls(**{f.name: getattr(ledger, f.name) for f in fields(Ledger)}, step_applied=applied)

    def report(self) -> str:
        """:meth:`Ledger.report`, and a line saying whether DeepSpeed applied the step."""
        if self.step_applied is None:
            return super().report()
        said = "applied" if self.step_applied else ("skipped on every rank (non-finite gradients after the "
                                                    "reduction: DeepSpeed's overflow check); the window is dropped")
        return f"{super().report()}\nDeepSpeed's step: {said}"


class DeepSpeedAccumulator(MicrobatchAccumulator):
    """Windows of a DeepSpeed ZeRO engine whose divisor is counted on all ranks. Made by :func:`exact`."""

    def __init__(self, engine: Any) -> None:
        """Wrap ``engine.step`` and ``engine.backward`` (see the module's docstring).

        Args:
            engine: a ZeRO stage 1, 2 or 3 float32 or bf16 ``DeepSpeedEngine``, any ``gradient_accumulation_steps``.

        Raises:
            GradaggError: see :func:`exact`.
        """
        problem = _unsupported(engine)
        if problem is not None:
            raise GradaggError(f"DeepSpeedAccumulator(engine): {problem}")
        self._engine = engine
        super().__init__(engine.module)
        self._finished = False  # finish() ran and engine.step() has not yet
        self._one_per_step_ruled_out = False  # a window had a rank with 2+ microbatches: not DeepSpeed's own loop
        # whether the caller declared this window's end (set_gradient_accumulation_boundary(True) since the last
        # step): recorded here, as DeepSpeed's own flag stays True after each step, and its counter of steps answers
        # for it before any was set
        self._declared = False
        self._step: Any = engine.step
        self._backward: Any = engine.backward
        self._set_boundary: Any = engine.set_gradient_accumulation_boundary
        # the instance's, see close()
        engine.step, engine.backward = self._wrapped_step, self._wrapped_backward
        engine.set_gradient_accumulation_boundary = self._wrapped_set_boundary

    def _chooser(self, fsdp: Mode, pad: Pad) -> Choose:
        engine = self._engine

        def choose(params: Params, group: Group, span: Any) -> Choice:
            def make() -> Wrapper:
                return DeepSpeedZero(engine, len(params.tensors), averages=bool(engine.gradient_average),
                                     wide=bool(engine.bfloat16_enabled()))

            return Choice(group, span, make)

        return choose

    @contextlib.contextmanager
    def microbatch(self, weight: object = None, *, last: bool = False) -> Iterator[Microbatch]:
        """One microbatch: run its ``engine.backward(loss_sum)`` (the unscaled sum) inside the ``with``.

        As :meth:`MicrobatchAccumulator.microbatch <gradagg.torch.MicrobatchAccumulator.microbatch>`; ``engine.step()``
        may run inside it after its backward (Accelerate's sync microbatch): the microbatch is then counted and the
        window finished there.

        Raises:
            WindowError: nested microbatches, or a microbatch after ``finish()`` and before ``engine.step()``.
            GradaggError: a weight that is not a real number or 0-dim real tensor.
        """
        if self._finished:
            raise WindowError("acc.microbatch() after finish() and before engine.step()", remedy="call engine.step()")
        with super().microbatch(weight, last=last) as mb:
            yield mb

    def finish(self) -> Ledger:
        """Close the window on every rank: count, divide, and let DeepSpeed reduce. ``engine.step()`` calls it.

        Returns:
            The window's :class:`~gradagg.torch.accumulate.ledger.Ledger` (also in ``acc.ledger``).

        Raises:
            WindowError: on every rank, naming the rank(s): an invalid weight, a poisoned window, weighted and
                unweighted microbatches mixed, no microbatch on any rank, or a total weight of 0. The window is
                dropped (DeepSpeed's reduction run on zeros) and no step is taken.
            CollectiveError: a rank did not reach the window's collective within the group's timeout.
        """
        last = self._state.last
        if self._finished and last is not None:
            return last
        if self._state.window.in_microbatch:
            self._end_microbatch()  # Accelerate's engine.step() inside the sync microbatch, after its backward
        try:
            ledger = super().finish()
        except WindowError:
            self.discard()  # DeepSpeed's block exits on zeros, on every rank: its reduction still runs
            raise
        self._finished = True
        return ledger

    @property
    def ledger(self) -> Ledger | None:  # type: ignore[override]
        """What the last finished window counted (None before the first); after its ``engine.step()``, a
        :class:`DeepSpeedLedger`, saying whether DeepSpeed applied the step."""
        return self._state.last

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """``engine.step()``: finish the window, then DeepSpeed's step (clipping, optimizer, scheduler)."""
        return self._wrapped_step(*args, **kwargs)

    def close(self) -> None:
        """Give ``engine.step`` and ``engine.backward`` back to DeepSpeed (a window still open is refused).

        Raises:
            WindowError: a window is open; finish it with ``engine.step()`` first.
        """
        if self._state.window.open and not self._state.closed:
            raise WindowError("close() with a window open", remedy="call engine.step() on every rank first")
        for name in ("step", "backward", "set_gradient_accumulation_boundary"):
            self._engine.__dict__.pop(name, None)
        super().close()

    def _wrapped_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._finished:
            self._refuse_deepspeeds_loop()
            self.finish()
        self._finished = False
        self._declared = False  # a declaration holds for its own window
        # A finished window must be stepped on: DeepSpeed's flush restored the boundary flag of the window's start
        # (Accelerate sets it False on every microbatch but the last), and a step skipped on a boundary False would
        # leave the reduced gradients for the next window's flush to add to.
        self._set_boundary(True)
        out = self._step(*args, **kwargs)
        last = self._state.last
        if last is not None:
            self._state.last = DeepSpeedLedger.after_step(last, self._engine)
        return out

    def _wrapped_set_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's ``set_gradient_accumulation_boundary``, its last value before ``engine.step()`` recorded."""
        self._declared = bool(is_boundary)
        self._set_boundary(is_boundary)

    def _refuse_deepspeeds_loop(self) -> None:
        """With ``gradient_accumulation_steps`` k > 1, refuse on every rank a window in which every rank ran exactly
        one microbatch that counts (a weight-0 one, ZeRO-3's padding, does not), none ran two, and not every rank
        declared the boundary: DeepSpeed's own loop (``engine.step()`` after every microbatch), which exact() would
        step k times as often as DeepSpeed does. Checked until a window in which some rank ran two or more
        microbatches, which DeepSpeed's loop never has: one all-reduce of three numbers per window until then.

        Raises:
            WindowError: on every rank (each decides from the same sums); the window is dropped (DeepSpeed's
                reduction runs on zeros) and nothing steps.
            CollectiveError: a rank did not reach ``engine.step()`` within the group's timeout.
        """
        steps = int(self._engine.gradient_accumulation_steps())
        if self._one_per_step_ruled_out or steps == 1:
            return
        st, w = self._state, self._state.window
        ran = w.m + int(w.in_microbatch)  # Accelerate steps inside its sync microbatch (and declares the boundary)
        counted = ran - sum(1 for v in weight_values(w.weights) if v == 0)
        declared = self._declared
        flags = torch.tensor([float(counted == 1), float(declared), float(ran >= 2)], dtype=torch.float64,
                             device=device_for(st.group))
        one, said, more = all_reduce_sum(flags, st.group).tolist()
        self._one_per_step_ruled_out = more > 0
        if one < st.world or said == st.world or more > 0:
            return
        if w.in_microbatch:
            self._end_microbatch()
        self.discard()
        raise WindowError(
            f"rank {st.rank}: engine.step() after one microbatch on every rank, with gradient_accumulation_steps "
            f"{steps} in the DeepSpeed config: that is DeepSpeed's own loop, whose optimizer steps on every "
            f"{steps}th engine.step(), but under exact(engine) every engine.step() ends the window and steps, so it "
            f"would step {steps} times as often; nothing was stepped and the window is dropped",
            remedy="call engine.step() once per window, after its last microbatch (any number per rank); a window of "
            "one microbatch per rank is declared with engine.set_gradient_accumulation_boundary(True) before its "
            "engine.step()",
        )

    def _wrapped_backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """DeepSpeed's backward, never divided by ``gradient_accumulation_steps`` (the window divides, once), always
        inside the window's block (a backward outside a microbatch is then refused by the accumulator's hooks)."""
        st = self._open_state()
        if not st.window.open:
            opening.open_window(st)
        return self._backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)


def exact(engine: Any) -> DeepSpeedAccumulator:
    """The accumulator for a DeepSpeed ZeRO engine: its windows close at ``engine.step()``, divided by the weights.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (from ``deepspeed.initialize``) with ZeRO stage 1, 2 or 3, float32
            or bf16, data parallelism only; any ``gradient_accumulation_steps`` (each ``engine.step()`` ends a window).

    Returns:
        A :class:`DeepSpeedAccumulator`; run each microbatch's backward in its ``microbatch(weight=...)``.

    Raises:
        GradaggError: naming what is unsupported: ZeRO stage 0, fp16, bf16 with ``data_types.grad_accum_dtype``
            other than bf16 or with ``bf16.check_grad_overflow`` false, pipeline, tensor or sequence
            parallelism, a DeepSpeed without ``coalesce_grad_reduction`` (before 0.19) or without the engine's
            ``gradient_average`` flag.

    >>> exact(torch.nn.Linear(2, 1))
    Traceback (most recent call last):
    ...
    gradagg.errors.GradaggError: exact(engine): a Linear is not a DeepSpeed 0.19+ engine (no coalesce_grad_reduction)
    """
    problem = _unsupported(engine)
    if problem is not None:
        raise GradaggError(f"exact(engine): {problem}")
    return DeepSpeedAccumulator(engine)


def _unsupported(engine: Any) -> str | None:
    if not hasattr(engine, "coalesce_grad_reduction"):
        return f"a {type(engine).__name__} is not a DeepSpeed 0.19+ engine (no coalesce_grad_reduction)"
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2, 3):
        return (f"ZeRO stage {stage} is not supported: DeepSpeed's coalesce_grad_reduction(), which keeps a window's "
                "gradients local, needs ZeRO stage 1, 2 or 3")
    problem = _precision_problem(engine, stage)
    if problem is not None:
        return problem
    if getattr(engine, "pipeline_parallelism", False) or not engine.managed_gradient_accumulation():
        return "pipeline parallelism and managed_gradient_accumulation=false are not supported"
    if not isinstance(getattr(engine, "gradient_average", None), bool):
        # DeepSpeed 0.19.8's engine attribute for its config's gradient_allreduce_op ("mean" or "sum"): without it,
        # whether its reduction averages or sums, and so each rank's share of D, is unknown
        return "the engine does not say whether its reduction averages or sums (no bool gradient_average)"
    if engine.dp_world_size != get_world_size():
        return (f"the data-parallel world has {engine.dp_world_size} ranks but the process group "
                f"{get_world_size()}: tensor, sequence or expert parallelism is not supported")
    return None


def _precision_problem(engine: Any, stage: int) -> str | None:
    """Why the engine's precision is refused (one line, naming what works), or None: float32, and bf16 with
    DeepSpeed's ZeRO optimizer and its overflow check."""
    if engine.fp16_enabled():
        # DeepSpeed's CPU accelerator refuses fp16, so its dynamic loss scaling under exact() could not be tested
        return ("fp16 is not supported (DeepSpeed's loss scaling under exact() is untested: its CPU accelerator has "
                "no fp16); use bf16 (\"bf16\": {\"enabled\": true}), or torch.amp fp16 with a GradScaler")
    if not engine.bfloat16_enabled():
        return None
    _, accum = engine.get_data_types()
    if accum != torch.bfloat16:
        # ZeRO-1 then runs DeepSpeed's BF16_Optimizer, which has no coalesce_grad_reduction(); ZeRO-2 and -3 are
        # not tested with it. gradagg's own window sum is float32 either way
        return (f"bf16 with data_types.grad_accum_dtype {str(accum).removeprefix('torch.')} is not supported; leave "
                "grad_accum_dtype unset: exact() keeps the window's sum in float32 itself")
    if _overflow_checked(engine) is not True:
        return ("bf16 with bf16.check_grad_overflow false (or unreadable) would step on a non-finite gradient; leave "
                "it true (DeepSpeed's default), which skips such a step on every rank")
    return None


def _overflow_checked(engine: Any) -> bool | None:
    """Whether DeepSpeed skips a bf16 step whose gradients are not finite (None: unknown).

    DeepSpeed 0.19.8 reads ``bf16.check_grad_overflow`` back only from its private parsed config
    (``engine._config.bfloat16_config``); with it off, its ZeRO bf16 step applies a non-finite gradient, with it on
    (the default) the overflow flag is all-reduced and the step skipped on every rank. Where that private path is
    gone, the answer is None and the engine is refused (tested with an engine without it).
    """
    value = getattr(getattr(getattr(engine, "_config", None), "bfloat16_config", None), "check_grad_overflow", None)
    return value if isinstance(value, bool) else None


__all__ = ["DeepSpeedAccumulator", "DeepSpeedLedger", "exact"]
