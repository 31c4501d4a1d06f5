"""Exact accumulation in a raw DeepSpeed ZeRO loop: ``acc = exact(engine)``.

DeepSpeed's own recipe back-propagates ``loss / gradient_accumulation_steps`` and averages over the ranks: the
mean of microbatch means, wrong when microbatches hold different token counts, divided by the configured steps
even in a short last window, and under ZeRO-2 and -3 it cannot run different microbatch counts per rank. With
the accumulator returned here a loop back-propagates each microbatch's *summed* loss::

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)  # gradient_accumulation_steps: 1
    acc = exact(engine)
    for window in windows:                        # any number of microbatches per rank, zero included
        for batch in window:
            with acc.microbatch(weight=n_tokens(batch)):
                engine.backward(loss_sum(engine, batch))
        engine.step()                             # one optimizer step per window, on every rank

What it does, and why:

* **the window** is what runs between two ``engine.step()`` calls. It is one ``engine.coalesce_grad_reduction()``
  block (DeepSpeed's public context: every backward inside keeps its gradient local, and the block's exit issues
  one reduction), opened by the first microbatch, or by ``engine.step()`` on a rank that ran none.
* **the divisor**: at ``engine.step()``, before the block exits, one small all-reduce sums every rank's weight
  and microbatch count, with a status, so that a bad weight on one rank raises on every rank. Every parameter
  without a local gradient gets a zero one (every rank must hand DeepSpeed's reduction the same tensors, or
  its collectives mismatch), every local gradient is multiplied by ``world / D``, and the block exits: DeepSpeed
  averages over the data-parallel ranks, so the gradient its optimizer applies, after its own clipping, is the
  sum over all microbatches divided by D, the total weight (M without weights).
* **gradient_accumulation_steps must be 1**: DeepSpeed steps on every k-th ``engine.step()``; here the window is
  the accumulation, and a loop that still called ``engine.step()`` after every microbatch would silently take k
  times as many steps, so ``exact`` refuses it instead. Each ``engine.step()`` steps the optimizer exactly once.
* **ZeRO-3** gathers parameters collectively in every forward: its ranks must run the same number of
  microbatches (a rank that ran out pads with ``acc.microbatch(weight=0)`` and ``engine.backward(0 * loss)``);
  unpadded, a collective times out (a ``CollectiveError`` on the rank waiting in the window's all-reduce).

``engine.step`` and ``engine.backward`` are wrapped on the engine instance (``close()`` restores them): the
backward never divides by ``gradient_accumulation_steps`` (``scale_wrt_gas=False``), a backward outside a
microbatch poisons the window (``engine.step()`` then raises on every rank), and a step always steps. Under
Accelerate's DeepSpeed plugin, ``acc = gradagg.integrations.accelerate.exact(accelerator, engine, optimizer)`` (this
class on the engine ``accelerator.prepare`` returned), then ``with accelerator.accumulate(engine): with
acc.microbatch(weight=n): accelerator.backward(loss_sum)``: Accelerate calls ``engine.step()`` inside the backward of
its sync microbatch, which closes the window there; a Hugging Face ``Trainer`` with ``deepspeed=`` goes the same way
under ``gradagg.integrations.transformers.exact(trainer)``.

Memory: inside the window every rank holds the full local gradient of every parameter (DeepSpeed's coalesced
reduction), where ZeRO-2 and -3 on their own reduce-scatter each microbatch and keep only their partition.
DeepSpeed is imported by the caller; this module does not import it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.torch.accumulate.ledger import Ledger
from gradagg.torch.accumulate.window import (
    OK,
    OUTSIDE,
    RAISED,
    STATUS_TEXT,
    WEIGHT,
    Weight,
    check_weight,
    weight_problem,
    weight_sum,
    weight_values,
)
from gradagg.torch.collectives import all_reduce_sum, get_rank, get_world_size

_FIELDS = 4  # per rank in the window's collective: microbatches, total weight, weighted microbatches, status


class DeepSpeedAccumulator:
    """Windows of a DeepSpeed ZeRO engine whose divisor is counted on all ranks. Made by :func:`exact`."""

    def __init__(self, engine: Any) -> None:
        """Wrap ``engine.step`` and ``engine.backward`` (see the module's docstring).

        Args:
            engine: a ZeRO stage 1, 2 or 3 float32 ``DeepSpeedEngine``. Its ``gradient_accumulation_steps`` is
                not checked here: Accelerate, which calls ``engine.step()`` only on its sync microbatch, may keep
                its own; a raw loop goes through :func:`exact`, which requires 1.

        Raises:
            GradaggError: see :func:`exact`.
        """
        problem = _unsupported(engine)
        if problem is not None:
            raise GradaggError(f"DeepSpeedAccumulator(engine): {problem}")
        self._engine = engine
        self._block: contextlib.ExitStack | None = None
        self._in_microbatch, self._touched = False, False
        self._closed = 0  # windows closed so far
        self._window_of_microbatch = 0
        self._reset()
        self._step: Callable[..., Any] = engine.step
        self._backward: Callable[..., Any] = engine.backward
        engine.step, engine.backward = self._wrapped_step, self._wrapped_backward  # the instance's, see close()
        self.ledger: Ledger | None = None
        """What the last finished window counted (None before the first)."""

    def _reset(self) -> None:
        self._weights: list[Weight] = []
        self._m = 0
        self._weighted = 0
        self._status, self._poison = OK, ""
        self._finished = False

    @contextlib.contextmanager
    def microbatch(self, weight: object = None) -> Iterator[None]:
        """One microbatch: run its ``engine.backward(loss_sum)`` (the unscaled sum) inside the ``with``.

        A microbatch that raises after its backward started poisons the window (``engine.step()`` then raises
        on every rank); one that raises before (e.g. in the forward) is not counted.

        Args:
            weight: what it counts for in the divisor (e.g. its number of valid tokens): a non-negative number
                or 0-dim tensor. Weight every microbatch of the window, on every rank, or none (D = M).

        Returns:
            A context manager.

        Raises:
            WindowError: nested microbatches, or a microbatch after ``finish()`` and before ``engine.step()``.
            GradaggError: a weight that is not a real number or 0-dim real tensor.
        """
        if self._in_microbatch:
            raise WindowError("acc.microbatch() entered inside another microbatch; microbatches do not nest")
        if self._finished:
            raise WindowError("acc.microbatch() after finish() and before engine.step()", remedy="call engine.step()")
        value = None if weight is None else check_weight(weight)
        self._open()
        self._count(value, 1)  # counted now: Accelerate calls engine.step() inside the sync microbatch's backward
        self._in_microbatch, self._touched, window = True, False, self._closed
        self._window_of_microbatch = window
        try:
            yield
        except BaseException:
            if window == self._closed and self._touched:
                self._fail(RAISED, f"microbatch {self._m - 1} raised after its backward started")
            elif window == self._closed:
                self._count(value, -1)  # raised before any gradient (e.g. in the forward): not counted
            raise
        finally:
            self._in_microbatch = False

    def _count(self, value: Weight | None, sign: int) -> None:
        self._m += sign
        if value is not None:
            self._weighted += sign
            if sign > 0:
                self._weights.append(value)
            else:
                self._weights.pop()

    def finish(self) -> Ledger:
        """Close the window on every rank: count, divide, and let DeepSpeed reduce. ``engine.step()`` calls it.

        Returns:
            The window's :class:`~gradagg.torch.accumulate.ledger.Ledger` (also in ``acc.ledger``).

        Raises:
            WindowError: on every rank, naming the rank(s): an invalid weight, a poisoned window, weighted and
                unweighted microbatches mixed, no microbatch on any rank, or a total weight of 0. The window is
                dropped (its gradients zeroed, DeepSpeed's reduction run on zeros) and no step is taken.
            CollectiveError: a rank did not reach the window's collective within the group's timeout.
        """
        if self._finished and self.ledger is not None:
            return self.ledger
        self._open()  # a rank that ran no microbatch takes part in the reduction too
        problem = weight_problem(self._weights, weight_values(self._weights))
        if problem is not None:
            self._fail(WEIGHT, problem)
        per_rank = self._exchange()
        try:
            divisor = _divisor(per_rank, get_rank(), self._poison)
        except WindowError:
            self._close(0.0)
            self._reset()
            self._closed += 1
            raise
        self._close(get_world_size() / divisor)
        self.ledger = self._ledger(per_rank, divisor)
        self._reset()
        self._closed += 1
        self._finished = True
        return self.ledger

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """``engine.step()``: finish the window, then DeepSpeed's step (clipping, optimizer, scheduler)."""
        return self._wrapped_step(*args, **kwargs)

    def close(self) -> None:
        """Give ``engine.step`` and ``engine.backward`` back to DeepSpeed (a window still open is refused).

        Raises:
            WindowError: a window is open; finish it with ``engine.step()`` first.
        """
        if self._block is not None:
            raise WindowError("close() with a window open", remedy="call engine.step() on every rank first")
        for name in ("step", "backward"):
            self._engine.__dict__.pop(name, None)

    def _wrapped_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._finished:
            self.finish()
        self._finished = False
        # A finished window must be stepped on: DeepSpeed's flush restored the boundary flag of the window's start
        # (Accelerate sets it False on every microbatch but the last), and a step skipped on a boundary False would
        # leave the reduced gradients for the next window's flush to add to.
        self._engine.set_gradient_accumulation_boundary(True)
        return self._step(*args, **kwargs)

    def _wrapped_backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """DeepSpeed's backward, never divided by ``gradient_accumulation_steps`` (the window divides, once)."""
        self._open()
        if not self._in_microbatch:
            self._fail(OUTSIDE, "engine.backward() ran outside acc.microbatch()")
        elif self._window_of_microbatch != self._closed:
            self._fail(OUTSIDE, "engine.backward() ran in a microbatch whose window engine.step() had closed")
        self._touched = True
        return self._backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    def _fail(self, code: int, why: str) -> None:
        if self._status == OK:
            self._status, self._poison = code, why

    def _open(self) -> None:
        if self._block is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self._engine.coalesce_grad_reduction())
            self._block = stack

    def _exchange(self) -> list[list[float]]:
        """Every rank's (microbatches, weight, weighted microbatches, status), in one float64 all-reduce."""
        world, rank = get_world_size(), get_rank()
        counters = torch.zeros(world * _FIELDS, dtype=torch.float64)
        mine = [self._m, weight_sum(weight_values(self._weights)), self._weighted, self._status]
        if self._status != OK:
            mine[1] = 0.0  # an invalid weight travels as the status; NaN here would hide the other ranks' sums
        counters[rank * _FIELDS:(rank + 1) * _FIELDS] = torch.tensor(mine, dtype=torch.float64)
        values = all_reduce_sum(counters).tolist()
        return [values[r * _FIELDS:(r + 1) * _FIELDS] for r in range(world)]

    def _close(self, factor: float) -> None:
        """Hand DeepSpeed the same tensors on every rank, scaled by ``factor`` (0: a refused window), then reduce."""
        for p in self._engine.module.parameters():
            if p.requires_grad:
                _scale_or_fill(p, factor)
        block, self._block = self._block, None
        if block is not None:
            block.close()  # DeepSpeed's flush: its one reduction of the window, averaged over the ranks

    def _ledger(self, per_rank: list[list[float]], divisor: float) -> Ledger:
        rank, weighted = get_rank(), any(r[2] for r in per_rank)
        return Ledger(
            rank=rank, world_size=len(per_rank), microbatches_local=int(per_rank[rank][0]),
            microbatches_global=int(sum(r[0] for r in per_rank)),
            microbatches_per_rank=tuple(int(r[0]) for r in per_rank), divisor=divisor,
            participation_local={}, participation_global=None,
            weighting="weighted" if weighted else "unweighted",
            weight_local=per_rank[rank][1] if weighted else None,
            weight_per_rank=tuple(r[1] for r in per_rank) if weighted else None,
            weight_global=divisor if weighted else None,
        )


def _scale_or_fill(p: torch.nn.Parameter, factor: float) -> None:
    """Multiply ``p``'s local gradient by ``factor``; give it a zero one when it has none.

    Under ZeRO-3 a parameter between forwards holds an empty partition, while its gradient has the full shape
    (``ds_shape``, DeepSpeed's attribute): torch's ``.grad`` setter refuses a gradient of another shape, so the
    zeros go in through ``.data``, as DeepSpeed's own stage 3 does.
    """
    if p.grad is not None:
        if factor == 0:
            p.grad.zero_()
        else:
            p.grad.mul_(factor)
        return
    shape = tuple(getattr(p, "ds_shape", p.shape))
    zeros = torch.zeros(shape, dtype=p.dtype, device=p.device)
    if tuple(p.shape) == shape:
        p.grad = zeros
    else:
        p.grad = torch.zeros_like(p)
        p.grad.data = zeros


def _divisor(per_rank: list[list[float]], rank: int, poison: str) -> float:
    """D from every rank's counters (the same on every rank), or a WindowError naming the ranks."""
    bad = [f"rank {r} {STATUS_TEXT.get(int(c[3]), f'failed (status {int(c[3])})')}"
           for r, c in enumerate(per_rank) if c[3] != OK]
    m, weighted = sum(c[0] for c in per_rank), sum(c[2] for c in per_rank)
    if not bad and 0 < weighted < m:
        bad.append(f"weighted and unweighted microbatches mixed ({int(weighted)} of {int(m)} weighted)")
    if not bad and m == 0:
        bad.append("no microbatch ran on any rank (M = 0): there is no mean to take")
    divisor = weight_sum([c[1] for c in per_rank]) if weighted else m
    if not bad and not (0 < divisor < math.inf):
        bad.append(f"the total weight is {divisor!r} (per rank: {[c[1] for c in per_rank]}): no mean to take")
    if bad:
        here = f" (here: {poison})" if poison else ""
        raise WindowError(f"rank {rank}: the window is refused on every rank and no step taken: {'; '.join(bad)}{here}")
    return divisor


def exact(engine: Any) -> DeepSpeedAccumulator:
    """The accumulator for a DeepSpeed ZeRO engine: its windows close at ``engine.step()``, divided by the weights.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (from ``deepspeed.initialize``) with ZeRO stage 1, 2 or 3, float32,
            ``gradient_accumulation_steps`` 1, data parallelism only.

    Returns:
        A :class:`DeepSpeedAccumulator`; run each microbatch's backward in its ``microbatch(weight=...)``.

    Raises:
        GradaggError: naming what is unsupported: ZeRO stage 0, fp16 or bf16, ``gradient_accumulation_steps``
            other than 1, pipeline, tensor or sequence parallelism, or a DeepSpeed without
            ``coalesce_grad_reduction`` (before 0.19).

    >>> exact(torch.nn.Linear(2, 1))
    Traceback (most recent call last):
    ...
    gradagg.errors.GradaggError: exact(engine): a Linear is not a DeepSpeed 0.19+ engine (no coalesce_grad_reduction)
    """
    problem = _unsupported(engine) or _steps_problem(engine)
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
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        return f"ZeRO stage {stage} with fp16 or bf16 is not supported yet: gradagg is verified with float32 only"
    if getattr(engine, "pipeline_parallelism", False) or not engine.managed_gradient_accumulation():
        return "pipeline parallelism and managed_gradient_accumulation=false are not supported"
    if engine.dp_world_size != get_world_size():
        return (f"the data-parallel world has {engine.dp_world_size} ranks but the process group "
                f"{get_world_size()}: tensor, sequence or expert parallelism is not supported")
    return None


def _steps_problem(engine: Any) -> str | None:
    steps = engine.gradient_accumulation_steps()
    if steps == 1:
        return None
    return (f"gradient_accumulation_steps is {steps} in the DeepSpeed config, expected 1: the window between two "
            f"engine.step() calls is the accumulation, and a loop that still called engine.step() after every "
            f"microbatch would step {steps} times as often as DeepSpeed does")


__all__ = ["DeepSpeedAccumulator", "exact"]
