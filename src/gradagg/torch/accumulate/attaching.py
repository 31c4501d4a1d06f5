"""``attach``: finish the window from the optimizer's step, for loops a framework owns.

Frameworks hand out wrappers, not torch optimizers: Accelerate's ``AcceleratedOptimizer`` (also HF Trainer's
``trainer.optimizer``) and Lightning's ``LightningOptimizer`` keep the torch optimizer in their public
``optimizer`` attribute and never call ``Optimizer.__init__`` (so they have no step hooks of their own);
torchtitan's ``OptimizersContainer`` keeps several in its public ``optimizers`` list. ``attach`` follows those
two attributes down to the torch optimizers whose ``step`` touches the gradients and registers a step
pre-hook on each (public ``Optimizer.register_step_pre_hook``). An object that is neither a known wrapper nor
has step hooks gets its ``step`` replaced on the instance (the tested fallback).

The pre-hook finishes a window still held (:func:`gradagg.torch.guard.due`: open on some rank, asked of every
rank, or none finished since this optimizer's last step): a clip before the step may have finished it already,
and a container's second optimizer must not finish again. A step
called with a closure (Lightning's automatic optimisation runs the last microbatch's forward and backward inside
it, after the pre-hooks) gets the closure wrapped instead: the window finishes when the closure returns, i.e.
after its backward and before the update.

Refused at ``attach()``: a second optimizer over parameters an attached one steps (each window's gradient would
be stepped twice); an Accelerate optimizer whose ``gradient_accumulation_steps`` is above 1, unless the
accumulator undoes Accelerate's division (``gradagg.integrations.accelerate.exact``'s does): ``accelerator.backward``
divides each microbatch's loss by it, so the summed loss the accumulator expects would arrive divided.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from gradagg.errors import GradaggError
from gradagg.torch import guard
from gradagg.torch.accumulate.state import State

Finish = Callable[[], object]


class Attachment:
    """What ``attach`` hooked; ``remove()`` undoes it (``close()`` does too)."""

    def __init__(self, state: State, objects: list[Any]) -> None:
        self.state, self.objects = state, objects
        self.handles: list[Any] = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        guard.detach_optimizers(self.state, self.objects)


def attach(state: State, optimizer: Any, finish: Finish, *, divides: bool = True) -> Attachment:
    """Run ``finish`` before ``optimizer`` updates (after its closure's backward, for a step with a closure).

    Args:
        state: the accumulator (the handle is kept in ``state.extra_hooks``, removed on close).
        optimizer: a torch optimizer, or a wrapper of one or several (Accelerate, Lightning, torchtitan).
        finish: the accumulator's ``finish``.
        divides: whether Accelerate's ``accelerator.backward`` still divides inside this accumulator's microbatches.

    Returns:
        The handle (``.remove()`` detaches).

    Raises:
        GradaggError: a second optimizer over attached parameters; Accelerate dividing (see the module docstring).
    """
    wrappers, leaves = _unwrap(optimizer)
    if divides:
        _refuse_accelerate_division(wrappers)
    guard.refuse_second(state, leaves)
    attachment = Attachment(state, [*wrappers, *leaves])
    for obj in wrappers:
        guard.attach_optimizer(state, obj, finish, leaf=False)
    for leaf in leaves:
        guard.attach_optimizer(state, leaf, finish, leaf=True)
        attachment.handles.append(_hook(state, leaf, finish))
    state.extra_hooks.append(attachment)
    return attachment


def _refuse_accelerate_division(wrappers: list[Any]) -> None:
    for obj in wrappers:
        # AcceleratedOptimizer's public gradient_state: the GradientState whose num_steps accelerator.backward reads
        steps = getattr(getattr(obj, "gradient_state", None), "num_steps", 1)
        if isinstance(steps, int) and steps > 1:
            raise GradaggError(
                f"attach({type(obj).__name__}): Accelerate's gradient_accumulation_steps is {steps}, so "
                f"accelerator.backward divides each microbatch's loss by {steps} and the window's gradient would be "
                f"1/{steps} of the mean; use gradagg.integrations.accelerate.exact(accelerator, model, optimizer), "
                "which undoes the division, or Accelerator(gradient_accumulation_steps=1)"
            )


def _unwrap(optimizer: Any) -> tuple[list[Any], list[Any]]:
    """(the wrappers passed through, the optimizers at the bottom), following ``optimizers`` and ``optimizer``."""
    many = getattr(optimizer, "optimizers", None)  # torchtitan's OptimizersContainer
    if isinstance(many, list | tuple) and many and all(_is_optimizer(o) for o in many):
        parts = [_unwrap(o) for o in many]
        return [optimizer, *(w for p in parts for w in p[0])], [leaf for p in parts for leaf in p[1]]
    inner = getattr(optimizer, "optimizer", None)  # Accelerate's and Lightning's wrappers
    if inner is not None and inner is not optimizer and _is_optimizer(inner):
        wrappers, leaves = _unwrap(inner)
        return [optimizer, *wrappers], leaves
    return [], [optimizer]


def _is_optimizer(obj: object) -> bool:
    return callable(getattr(obj, "step", None)) and hasattr(obj, "param_groups")


def _hook(state: State, leaf: Any, finish: Finish) -> Any:
    def finish_first(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _before_step(state, opt, finish, args, kwargs, at=1)  # a step hook's args start with the optimizer

    try:
        return leaf.register_step_pre_hook(finish_first)
    except AttributeError:
        # an Optimizer subclass that skipped Optimizer.__init__ (no hook registry) and wraps nothing we know
        return _StepReplaced(state, leaf, finish)


def _before_step(
    state: State, opt: Any, finish: Finish, args: tuple[Any, ...], kwargs: dict[str, Any], *, at: int
) -> Any:
    """Finish now, or (a step with a closure, positional at ``at``) when the closure returns; None: unchanged.

    Finished only if still held: a clip, or another optimizer of the same container, may have finished it."""
    closure = kwargs.get("closure", args[at] if len(args) > at else None)
    if closure is None:
        if guard.due(state, opt):
            finish()
        return None

    def closure_then_finish() -> Any:
        out = closure()
        if guard.due(state, opt):  # the closure ran the window's last backward; a clip in it may have finished
            finish()
        return out

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_finish}
    return (*args[:at], closure_then_finish, *args[at + 1 :]), kwargs


class _StepReplaced:
    """The fallback: ``leaf.step`` replaced on the instance by one that finishes first; ``remove()`` restores."""

    def __init__(self, state: State, leaf: Any, finish: Finish) -> None:
        self.leaf, had = leaf, "step" in vars(leaf)
        self.previous = vars(leaf).get("step")
        original = leaf.step

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            changed = _before_step(state, leaf, finish, args, kwargs, at=0)
            if changed is not None:
                args, kwargs = changed
            out = original(*args, **kwargs)
            guard.note_step(leaf)  # no global post-hook runs for an object without step hooks
            return out

        leaf.step = step
        self.had = had

    def remove(self) -> None:
        if self.had:
            self.leaf.step = self.previous
        else:
            vars(self.leaf).pop("step", None)


__all__ = ["Attachment", "attach"]
