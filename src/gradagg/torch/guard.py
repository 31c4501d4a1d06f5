"""No step or clip may silently miss the gradients an accumulator still holds.

During a window every counted gradient sits in the accumulator's buffer and ``.grad`` is None (see
:mod:`gradagg.torch.accumulate.hooks`). A gradient clip or an optimizer step that runs before ``finish()``
would see nothing: the clip clips nothing, the step skips every parameter, silently. This module keeps
that from happening, with one rule that every rank evaluates the same way without communicating.

**Held.** An accumulator's gradients are *held* for an optimizer when no window was finished (or discarded)
since that optimizer's last step over the accumulator's parameters: every finish and discard starts a new
window object (:meth:`State.new_window`), so "the current window is the one this optimizer last stepped in"
is the test. Ranks step and finish in lockstep, so the answer is the same on a rank that ran no microbatch
(whose window is not even open) as on one that ran several. Before an optimizer's first step the window of
the accumulator's birth is the mark. A clip over some parameters asks the optimizers that hold any of
them; when none has stepped yet, the birth window is the mark. In one process (no group, or a group of
one) nothing needs agreeing: the clips and steps ask whether the window is open.

**Made right or refused, on every rank.**

* ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` over held parameters: with
  :meth:`~gradagg.torch.MicrobatchAccumulator.attach`, the window is finished first (a collective every
  rank runs here, as every rank clips), then the clip runs on the exact gradients; without it,
  :class:`~gradagg.errors.WindowError`, naming the clip and the fix.
* ``torch.nn.utils.clip_grads_with_norm_`` over held parameters: always refused, since its norm was
  computed before (torchtitan and Accelerate call ``get_total_norm([p.grad ...])``, which saw no gradient).
* an optimizer step over held parameters of an accumulator not attached to it: refused. Before that
  optimizer's first step only a rank whose window is open refuses (a rank with nothing held, before any step,
  cannot be told from a correct loop: its peer's error then ends the run at its next collective).
* ``get_total_norm(tensors)`` takes gradients, not parameters: an empty list (``.grad`` None) names no
  accumulator, so it is not guarded itself; the clip that follows it is.

**Mechanism.** While at least one accumulator is alive (registered at construction, unregistered by
``close()`` or when it is garbage-collected), the four functions above are replaced in ``torch.nn.utils``
(and ``torch.nn.utils.clip_grad``) by wrappers that check, then call the original; and a global optimizer
step pre- and post-hook (the public ``torch.optim.optimizer.register_optimizer_step_pre_hook``) records each
optimizer's step. Frameworks look these functions up as attributes of ``torch.nn.utils`` when they call them
(HF Trainer through Accelerate, Lightning's precision plugins, torchtitan's ``dist_utils``), so they meet
the wrappers; code that imported a function by name before the first accumulator was built does not.
The originals are put back when the last accumulator goes (unless someone replaced them meanwhile).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gradagg.errors import WindowError
from gradagg.torch.collectives import get_world_size

if TYPE_CHECKING:
    from gradagg.torch.accumulate.state import State
    from gradagg.torch.accumulate.window import Window

Finish = Callable[[], object]


@dataclass(eq=False)
class Entry:
    """One live accumulator, as the guard knows it.

    Attributes:
        state: the accumulator's state (weakly: the guard never keeps an accumulator alive).
        born: the window current when it was built: the mark before any step.
        marks: optimizer -> (the accumulator's parameter indices it holds, the window of its last step).
        attached: the optimizers (wrappers and inner ones) ``attach`` hooked, with the finish to run.
    """

    state: weakref.ReferenceType[State]
    born: weakref.ReferenceType[Window]
    marks: weakref.WeakKeyDictionary[Any, tuple[frozenset[int], weakref.ReferenceType[Window]]] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    attached: weakref.WeakKeyDictionary[Any, Finish] = field(default_factory=weakref.WeakKeyDictionary)


_entries: dict[int, Entry] = {}  # id(state) -> entry, while the state lives and is not closed


class Registration:
    """The handle :func:`register` returns; ``remove()`` (run by ``close()``) forgets the accumulator."""

    def __init__(self, key: int) -> None:
        self.key = key

    def remove(self) -> None:
        _forget(self.key)


def register(state: State) -> Registration:
    """Guard ``state``'s held gradients from now on (see the module docstring)."""
    key = id(state)
    _entries[key] = Entry(weakref.ref(state, lambda _ref: _forget(key)), weakref.ref(state.window))
    _patching.install()
    return Registration(key)


def _forget(key: int) -> None:
    if _entries.pop(key, None) is not None and not _entries:
        _patching.uninstall()


def entry_of(state: State) -> Entry:
    """The entry of a registered accumulator.

    Raises:
        WindowError: the accumulator was closed.
    """
    entry = _entries.get(id(state))
    if entry is None or entry.state() is not state:
        raise WindowError("this accumulator was closed (its hooks are gone); create a new one")
    return entry


def index_of(state: State) -> dict[int, int]:
    """id(tensor) -> parameter index, for the accumulated parameters and (FSDP2) their unsharded tensors."""
    out = {id(t): i for i, t in enumerate(state.tensors)}
    out.update((id(t), i) for i, t in state.unsharded.items())
    return out


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer holds (``param_groups``, public on every torch optimizer and wrapper)."""
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]


def _indices(state: State, tensors: Iterable[object]) -> frozenset[int]:
    where = index_of(state)
    return frozenset(where[id(t)] for t in tensors if id(t) in where)


def held_for(state: State, optimizer: Any) -> bool:
    """Whether no window was finished or discarded since ``optimizer``'s last step (or since the accumulator
    was built, before its first): the same answer on every rank."""
    entry = entry_of(state)
    mark = entry.marks.get(optimizer)
    window = entry.born if mark is None else mark[1]
    return window() is state.window


def attach_optimizer(state: State, optimizer: Any, finish: Finish, *, leaf: bool) -> None:
    """Record that ``attach`` hooked ``optimizer`` (a leaf: a torch optimizer whose step pre-hook finishes)."""
    entry = entry_of(state)
    entry.attached[optimizer] = finish
    if leaf and optimizer not in entry.marks:
        # its next step finishes the current window (which may already be open): mark it as the held one
        entry.marks[optimizer] = (_indices(state, optimizer_params(optimizer)), weakref.ref(state.window))


def detach_optimizers(state: State, objects: list[Any]) -> None:
    """Forget what ``attach`` recorded for ``objects`` (a closed accumulator has nothing to forget)."""
    entry = _entries.get(id(state))
    for obj in objects if entry is not None else ():
        entry.attached.pop(obj, None)  # type: ignore[union-attr]


def note_step(optimizer: Any) -> None:
    """After any optimizer's step: the accumulators over its parameters hold nothing for it until next window."""
    tensors = optimizer_params(optimizer)
    for entry in list(_entries.values()):
        state = entry.state()
        if state is None:
            continue
        mine = _indices(state, tensors)
        if mine:
            entry.marks[optimizer] = (mine, weakref.ref(state.window))


def _live() -> list[tuple[Entry, State]]:
    return [(e, s) for e in list(_entries.values()) if (s := e.state()) is not None and not s.closed]


# --- the optimizer step -------------------------------------------------------------------------------


def check_step(optimizer: Any) -> None:
    """Before any optimizer's step: refuse one that would skip gradients an accumulator still holds.

    Raises:
        WindowError: held gradients of an accumulator not attached to this optimizer (see the module docstring).
    """
    tensors = optimizer_params(optimizer)
    for entry, state in _live():
        if optimizer in entry.attached or not _indices(state, tensors):
            continue
        held = state.window.open
        if optimizer in entry.marks and get_world_size(state.group) > 1:
            held = held_for(state, optimizer)  # the rank-independent answer, where other ranks must agree
        if held:
            raise WindowError(
                f"{type(optimizer).__name__}.step() would skip the gradients the accumulator still holds (no finish() "
                "since this optimizer's last step: .grad is None until finish()); call acc.finish() before "
                "optimizer.step(), or acc.attach(optimizer) so that its step finishes the window first "
                "(or close() an accumulator no longer used)"
            )


def _step_pre_hook(optimizer: Any, _args: object, _kwargs: object) -> None:
    check_step(optimizer)


def _step_post_hook(optimizer: Any, _args: object, _kwargs: object) -> None:
    note_step(optimizer)


# --- the clips ----------------------------------------------------------------------------------------


def _held_in_clip(entry: Entry, state: State, mine: frozenset[int]) -> bool:
    """Held for the clipped parameters ``mine``: by the optimizers that hold any of them, else since birth."""
    if get_world_size(state.group) == 1:
        return state.window.open  # one process: what is held is exactly what an open window holds
    marks = [window for opt_mine, window in entry.marks.values() if opt_mine & mine]
    if not marks:
        return entry.born() is state.window
    return any(window() is state.window for window in marks)


def before_clip(name: str, tensors: list[torch.Tensor], *, can_finish: bool) -> None:
    """Before ``torch.nn.utils.<name>`` over ``tensors``: finish the windows it would miss, or refuse.

    Raises:
        WindowError: held gradients that cannot be made right here (see the module docstring).
    """
    for entry, state in _live():
        mine = _indices(state, tensors)
        if not mine or not _held_in_clip(entry, state, mine):
            continue
        finish = next(iter(entry.attached.values()), None)
        if state.window.in_microbatch:
            raise WindowError(f"torch.nn.utils.{name} called inside microbatch(): clip after finish()")
        if can_finish and finish is not None:
            finish()  # attached: every rank clips here, so every rank finishes here, then clips the exact gradient
            continue
        why = "(the norm was computed before, on no gradient) " if name == "clip_grads_with_norm_" else ""
        raise WindowError(
            f"torch.nn.utils.{name} called on parameters whose gradients the accumulator still holds {why}(the "
            "window was not finished: .grad is None, nothing would be clipped); call acc.finish() before clipping"
            + ("" if name == "clip_grads_with_norm_" else ", or acc.attach(optimizer): a clip then finishes first")
        )


def _as_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _guarded(name: str, original: Callable[..., Any], *, can_finish: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(parameters: torch.Tensor | Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        params = _as_list(parameters)  # a generator would be spent by the check: pass the list on
        before_clip(name, params, can_finish=can_finish)
        return original(params, *args, **kwargs)

    guarded.__gradagg_original__ = original  # type: ignore[attr-defined]
    return guarded


_CLIPS = {"clip_grad_norm_": True, "clip_grad_value_": True, "clip_grads_with_norm_": False}


class _Patching:
    """The wrappers in ``torch.nn.utils`` and the global step hooks, while any accumulator is alive."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.wrappers: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        if self.handles:
            return
        import torch.nn.utils.clip_grad as clip_module
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        for name, can_finish in _CLIPS.items():
            original = getattr(torch.nn.utils, name)
            original = getattr(original, "__gradagg_original__", original)
            self.wrappers[name] = _guarded(name, original, can_finish=can_finish)
            for where in (torch.nn.utils, clip_module):
                setattr(where, name, self.wrappers[name])
        self.handles = [
            register_optimizer_step_pre_hook(_step_pre_hook),
            register_optimizer_step_post_hook(_step_post_hook),
        ]

    def uninstall(self) -> None:
        import torch.nn.utils.clip_grad as clip_module

        for name, wrapper in self.wrappers.items():
            for where in (torch.nn.utils, clip_module):
                if getattr(where, name, None) is wrapper:  # someone else's replacement stays
                    setattr(where, name, wrapper.__gradagg_original__)  # type: ignore[attr-defined]
        for h in self.handles:
            h.remove()
        self.handles, self.wrappers = [], {}


_patching = _Patching()


def guarded_functions() -> dict[str, Callable[..., Any]]:
    """The wrappers now in ``torch.nn.utils`` (empty while no accumulator is alive), for tests and tools."""
    return dict(_patching.wrappers)


__all__ = [
    "Entry",
    "Registration",
    "attach_optimizer",
    "before_clip",
    "check_step",
    "detach_optimizers",
    "entry_of",
    "guarded_functions",
    "held_for",
    "index_of",
    "note_step",
    "optimizer_params",
    "register",
]
