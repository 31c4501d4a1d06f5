"""No step or clip may silently miss the gradients an accumulator still holds.

During a window every counted gradient sits in the accumulator's buffer and ``.grad`` holds none (None, or once
a backward's gradient was taken a placeholder that refuses any read: see :mod:`gradagg.torch.accumulate.hooks`
and :mod:`gradagg.torch.held`). A gradient clip or an optimizer step that runs before ``finish()`` would see nothing:
the clip clips nothing, the step skips every parameter, silently. This module keeps that from happening, with
one rule that every rank evaluates the same way.

**Held.** An accumulator's gradients are *held* while a window is open on any rank of its group: counted
gradients sit in its buffer and ``.grad`` holds none. A rank whose own window is not open (it ran no microbatch
yet) cannot see that alone, so a clip or step over an accumulator's parameters in a group of several ranks asks
them, with one small ``all_gather`` (:func:`agree`): each rank sends the accumulator's identity (see
:mod:`gradagg.torch.accumulate.lifetime`), whether its window is open and whether it is inside a microbatch. Every
rank gets the same answer and decides alike; ranks that name different accumulators all refuse. Clips and steps
run on every rank in data-parallel training (as the collectives of ``finish()`` do); one called on some ranks
only fails with :class:`~gradagg.errors.CollectiveError` at the collective timeout. In one process (no group, or
a group of one) nothing needs agreeing: the window open is what is held. (Inferring "held" without asking, from
each optimizer's last step, missed every loop where no step marks a window's end: weights updated by hand, a
``discard()``, an optimizer re-created.) One exception, attached and under a wrapper whose windows open together
(FSDP2 unshards every module, the shards forms agree each microbatch's round): when no window was finished since
an attached optimizer's last step, a clip or step finishes without asking, since a rank that ran no microbatch
must first join the opening collective the others wait in (:func:`_finish_due`).

**Made right or refused, on every rank.**

* ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` over held parameters: with
  :meth:`~gradagg.torch.MicrobatchAccumulator.attach`, the window is finished first (a collective every
  rank runs here, as every rank clips), then the clip runs on the exact gradients; without it,
  :class:`~gradagg.errors.WindowError`, naming the clip and the fix.
* FSDP1's own ``FullyShardedDataParallel.clip_grad_norm_`` (a method, wrapped once FSDP1 is imported): the same
  as ``clip_grad_norm_``, over the module's parameters.
* ``torch.amp.GradScaler.unscale_``, and FSDP's ``ShardedGradScaler.unscale_`` (its own method, wrapped once
  ``torch.distributed.fsdp.sharded_grad_scaler`` is imported): a reader like a clip, and its scale readied on a
  rank that ran no microbatch in the window. ``GradScaler.step`` (both scalers'): a step it skips for an inf or
  NaN is marked like a step, as the window it finished is spent.
* ``torch.nn.utils.clip_grads_with_norm_`` over held parameters: always refused, since its norm was
  computed before (torchtitan and Accelerate call ``get_total_norm([p.grad ...])``, which saw no gradient).
* an optimizer step over held parameters of an accumulator not attached to it: refused. A step while no window
  is open anywhere (``torch.distributed.checkpoint``'s zero-gradient step that creates an optimizer's state
  before loading) passes.
* a clip or step inside a ``microbatch()`` on any rank: refused on every rank.
* ``get_total_norm(tensors)`` takes gradients, not parameters: an empty list (``.grad`` None) names no
  accumulator, so it is not guarded itself; the clip that follows it is.

**Mechanism.** While at least one accumulator is alive (registered at construction, unregistered by
``close()`` or when it is garbage-collected), the clips above are replaced in ``torch.nn.utils`` (and
``torch.nn.utils.clip_grad``) and the scalers' methods on their classes by wrappers that check, then call the
original; and a global optimizer
step pre- and post-hook (the public ``torch.optim.optimizer.register_optimizer_step_pre_hook``) checks each
optimizer's step and marks an attached one's. Frameworks look these functions up as attributes of
``torch.nn.utils`` when they call them (HF Trainer through Accelerate, Lightning's precision plugins,
torchtitan's ``dist_utils``), so they meet the wrappers. Code that holds a function by another name (imported
before the first accumulator was built, a ``functools.partial``, ``get_total_norm`` or ``torch._foreach_norm`` by
hand) does not: it meets the placeholders that stand in ``.grad`` once a backward's gradient was taken instead
(:mod:`gradagg.torch.held`), which refuse any read and fail the window, so that :func:`agree` and ``finish()``
refuse it on every rank. The step hooks are global: an optimizer built before the first accumulator, or its
``step`` held as a bound method, meets them too. The originals are put back when the last accumulator goes
(unless someone replaced them meanwhile).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.torch.accumulate.window import READ
from gradagg.torch.collectives import all_gather_into
from gradagg.torch.held import Veil

if TYPE_CHECKING:
    from gradagg.torch.accumulate.state import State

Finish = Callable[[], object]


@dataclass(eq=False)
class Entry:
    """One live accumulator, as the guard knows it.

    Attributes:
        state: the accumulator's state (weakly: the guard never keeps an accumulator alive).
        attached: the optimizers (wrappers and inner ones) ``attach`` hooked, with the finish to run.
        leaves: those whose step touches the gradients (torch optimizers), for :func:`refuse_second`.
        marks: attached leaf -> ``state.finished`` at its last step (or at ``attach``), see :func:`due`.
        veil: the placeholders in the parameters' ``.grad`` between microbatches (see :mod:`gradagg.torch.held`).
    """

    state: weakref.ReferenceType[State]
    attached: weakref.WeakKeyDictionary[Any, Finish] = field(default_factory=weakref.WeakKeyDictionary)
    leaves: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    marks: weakref.WeakKeyDictionary[Any, int] = field(default_factory=weakref.WeakKeyDictionary)
    veil: Veil = field(default_factory=Veil)


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
    _entries[key] = Entry(weakref.ref(state, lambda _ref: _forget(key)))
    _patching.install()
    _patching.install_fsdp1()  # FSDP1 may have been imported since the first accumulator was built
    return Registration(key)


def _forget(key: int) -> None:
    entry = _entries.pop(key, None)
    if entry is not None:
        entry.veil.lift()  # closed or dropped mid-window: no placeholder outlives its accumulator
        if not _entries:
            _patching.uninstall()


def veil(state: State) -> None:
    """Between microbatches of an open window: the held gradients' placeholders into ``.grad`` (see
    :mod:`gradagg.torch.held`)."""
    entry = _entries.get(id(state))
    if entry is not None and entry.state() is state:
        entry.veil.put(state)


def veil_one(state: State, i: int, t: torch.Tensor) -> None:
    """Inside a microbatch, once its gradient was taken: parameter ``i``'s placeholder into ``.grad``."""
    entry = _entries.get(id(state))
    if entry is not None and entry.state() is state:
        entry.veil.put_one(state, i, t)


def unveil(state: State) -> None:
    """Before the accumulator's own work on ``.grad`` (a microbatch, ``finish()``, ``discard()``): back to None."""
    entry = _entries.get(id(state))
    if entry is not None and entry.state() is state:
        entry.veil.lift()


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
    out.update((id(t), i) for i, t in state.wrapper.held().items())
    return out


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer holds (``param_groups``, public on every torch optimizer and wrapper)."""
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]


def _indices(state: State, tensors: Iterable[object]) -> frozenset[int]:
    where = index_of(state)
    return frozenset(where[id(t)] for t in tensors if id(t) in where)


def _live() -> list[tuple[Entry, State]]:
    return [(e, s) for e in list(_entries.values()) if (s := e.state()) is not None and not s.closed]


def holder_of(tensors: Sequence[torch.Tensor]) -> tuple[State, int, int] | None:
    """The live accumulator holding one of ``tensors``: ``(its state, its parameter index, the index in tensors)``."""
    for _, state in _live():
        where = index_of(state)
        for k, t in enumerate(tensors):
            if id(t) in where:
                return state, where[id(t)], k
    return None


# --- held: agreed by the ranks ------------------------------------------------------------------------


def agree(state: State, what: str) -> bool:
    """Whether ``state``'s window is open on any rank of its group (one ``all_gather`` in a group of several).

    Args:
        state: the accumulator.
        what: the clip or step asking, for messages.

    Returns:
        True when gradients are held (a window open somewhere).

    Raises:
        WindowError: on every rank, when a rank is inside ``microbatch()``, or a rank's window was failed by a read
            of its held gradients (:mod:`gradagg.torch.held`), or the ranks ask about different accumulators (built
            or used in another order).
        CollectiveError: the collective failed or timed out (a rank that did not clip or step).
    """
    w = state.window
    row = [*state.identity, float(w.open), float(w.in_microbatch), float(w.status == READ)]
    if state.world == 1:
        rows = [row]
    else:
        mine = torch.tensor(row, dtype=torch.float64).to(state.device)
        out = all_gather_into(torch.empty(mine.numel() * state.world, dtype=mine.dtype,
                                          device=mine.device), mine, state.group)
        rows = out.view(-1, len(row)).tolist()
    ids = [(int(r[0]), int(r[1])) for r in rows]
    if len(set(ids)) > 1:
        names = "; ".join(f"rank {r}: accumulator #{i[0]} (layout {i[1]:08x})" for r, i in enumerate(ids))
        raise WindowError(
            f"rank {state.rank}: {what} reached different accumulators on different ranks ({names}): "
            "build the accumulators, and finish, clip and step them, in the same order on every rank"
        )
    inside = [r for r, row in enumerate(rows) if row[3]]
    if inside:
        raise WindowError(f"{what} called inside microbatch() (on rank(s) {inside}): clip and step after finish()")
    read = [r for r, row in enumerate(rows) if row[4]]
    if read:
        raise WindowError(
            f"rank {state.rank}: {what} refused: on rank(s) {read} something read the gradients {state.label()} still "
            "held, before finish() (a norm or clip by a name taken before the accumulator was built?); discard() the "
            "window on every rank"
        )
    return any(row[2] for row in rows)


# --- the optimizer step -------------------------------------------------------------------------------


def attach_optimizer(state: State, optimizer: Any, finish: Finish, *, leaf: bool) -> None:
    """Record that ``attach`` hooked ``optimizer`` (a leaf: a torch optimizer whose step pre-hook finishes)."""
    entry = entry_of(state)
    entry.attached[optimizer] = finish
    if leaf:
        entry.leaves.add(optimizer)
        entry.marks.setdefault(optimizer, state.finished)


def due(state: State, optimizer: Any) -> bool:
    """Whether an attached ``optimizer``'s step must finish the window first: a window is open on some rank
    (:func:`agree`; not asked where :func:`_finish_due`), or no window was finished since its last step (or its
    ``attach``); the latter finishes an empty window, which refuses (M = 0) on every rank, rather than step on no
    gradient or an unreduced one."""
    what = f"{type(optimizer).__name__}.step()"
    entry = entry_of(state)
    unfinished = entry.marks.get(optimizer) == state.finished  # no window finished since its last step
    if unfinished and _finish_due(entry, state):
        _refuse_inside(state, what)
        return True
    return agree(state, what) or unfinished


def _finish_due(entry: Entry, state: State) -> bool:
    """Whether an attached clip or step must finish without asking the ranks (:func:`agree`) first: the wrapper
    opens windows together (``Wrapper.opens_together``: FSDP2 unshards every module, the shards forms agree each
    microbatch's round) in a group of several ranks, and no window was finished since an attached optimizer's last
    step. Every rank decides alike (each finishes and steps alike; the wrapper is the same everywhere).

    There a rank that ran no microbatch must join the window's opening collective, which the other ranks already
    wait in, before any other: its ``finish()`` opens the window first, where :func:`agree`'s ``all_gather`` would
    meet theirs (gloo aborts on the sizes). ``finish()`` refuses what :func:`agree` refuses, on every rank: another
    accumulator, a held gradient read; a rank inside a microbatch refuses here (:func:`_refuse_inside`). Elsewhere
    the ranks are asked, and a clip with no window open anywhere passes.
    """
    if state.world == 1 or not state.wrapper.opens_together:
        return False
    return any(entry.marks.get(leaf) == state.finished for leaf in list(entry.leaves))


def _refuse_inside(state: State, what: str) -> None:
    if state.window.in_microbatch:
        raise WindowError(f"{what} called inside microbatch() (on rank {state.rank}): clip and step after finish()")


def note_step(optimizer: Any) -> None:
    """After any optimizer's step: mark it, for the accumulators it is attached to (see :func:`due`)."""
    for entry, state in _live():
        if optimizer in entry.leaves:
            entry.marks[optimizer] = state.finished


def refuse_second(state: State, leaves: list[Any]) -> None:
    """Refuse to attach an optimizer over parameters that another attached optimizer steps too.

    Raises:
        GradaggError: naming both optimizers and a shared parameter.
    """
    entry = entry_of(state)
    for leaf in leaves:
        mine = _indices(state, optimizer_params(leaf))
        for other in list(entry.leaves):
            shared = mine & _indices(state, optimizer_params(other)) if other is not leaf else frozenset()
            if shared:
                raise GradaggError(
                    f"attach(): {type(other).__name__} at {id(other):#x} is already attached over parameter "
                    f"{state.names[min(shared)]!r}, which {type(leaf).__name__} at {id(leaf):#x} steps too: both "
                    "would step each window's gradient; remove() the first attach()'s handle (or attach a container "
                    "of optimizers over disjoint parameters)"
                )


def detach_optimizers(state: State, objects: list[Any]) -> None:
    """Forget what ``attach`` recorded for ``objects`` (a closed accumulator has nothing to forget)."""
    entry = _entries.get(id(state))
    for obj in objects if entry is not None else ():
        entry.attached.pop(obj, None)  # type: ignore[union-attr]
        entry.leaves.discard(obj)  # type: ignore[union-attr]


def check_step(optimizer: Any) -> None:
    """Before any optimizer's step: refuse one that would skip gradients an accumulator still holds.

    Raises:
        WindowError: held gradients of an accumulator not attached to this optimizer (see the module docstring).
    """
    tensors = optimizer_params(optimizer)
    what = f"{type(optimizer).__name__}.step()"
    for entry, state in _live():
        if optimizer in entry.attached or not _indices(state, tensors):
            continue
        if agree(state, what):
            raise WindowError(
                f"{what} would skip the gradients {state.label()} still holds (a window is open on some rank: "
                ".grad holds none until finish()); call acc.finish() before optimizer.step(), or acc.attach(optimizer) "
                "so that its step finishes the window first (or close() an accumulator no longer used)"
            )


def _step_pre_hook(optimizer: Any, _args: object, _kwargs: object) -> None:
    check_step(optimizer)


def _step_post_hook(optimizer: Any, _args: object, _kwargs: object) -> None:
    note_step(optimizer)


# --- the clips ----------------------------------------------------------------------------------------


def before_clip(name: str, tensors: list[torch.Tensor], *, can_finish: bool) -> list[torch.Tensor]:
    """Before ``torch.nn.utils.<name>`` over ``tensors``: finish the windows it would miss, or refuse.

    Returns:
        The tensors to clip: ``tensors``, each of a window's unsharded parameters (FSDP2's window form: what
        ``model.parameters()`` yields while its window is open) replaced by its sharded parameter once that window
        finished here, which holds the gradient now (the unsharded tensor is freed, its ``.grad`` None).

    Raises:
        WindowError: held gradients that cannot be made right here (see the module docstring).
    """
    what = name if "." in name else f"torch.nn.utils.{name}"  # (GradScaler.unscale_ comes by its own name)
    for entry, state in _live():
        if not _indices(state, tensors):
            continue
        finish = next(iter(entry.attached.values()), None)
        if can_finish and finish is not None and _finish_due(entry, state):
            _refuse_inside(state, what)
            tensors = _finished_here(state, finish, tensors)  # see _finish_due: every rank clips here, then steps
            continue
        if not agree(state, what):
            continue
        if can_finish and finish is not None:
            # attached: every rank clips here, so every rank finishes here, then clips the exact gradient
            tensors = _finished_here(state, finish, tensors)
            continue
        why = "(the norm was computed before, on no gradient) " if name == "clip_grads_with_norm_" else ""
        raise WindowError(
            f"{what} called on parameters whose gradients {state.label()} still holds {why}(the "
            "window was not finished: .grad holds none, nothing would be clipped); call acc.finish() before clipping"
            + ("" if name == "clip_grads_with_norm_" else ", or acc.attach(optimizer): a clip then finishes first")
        )
    return tensors


def _finished_here(state: State, finish: Finish, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``finish``; ``tensors`` with the window's unsharded parameters replaced by the sharded ones."""
    sharded = {id(t): state.tensors[i] for i, t in state.wrapper.held().items()}
    finish()
    return [sharded.get(id(t), t) for t in tensors]


def _as_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _guarded(name: str, original: Callable[..., Any], *, can_finish: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(parameters: torch.Tensor | Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        params = _as_list(parameters)  # a generator would be spent by the check: pass the list on
        return original(before_clip(name, params, can_finish=can_finish), *args, **kwargs)

    guarded.__gradagg_original__ = original  # type: ignore[attr-defined]
    return guarded


_CLIPS = {"clip_grad_norm_": True, "clip_grad_value_": True, "clip_grads_with_norm_": False}


def _guarded_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.amp.GradScaler.unscale_`` (and ``ShardedGradScaler``'s): a reader of the gradients like a clip (an
    attached window finishes first, an unattached one is refused), and a scale ready on a rank that ran no
    microbatch.

    GradScaler sets its scale at its first ``scale(loss)``; a rank with no microbatch in the window never called
    it, yet ``finish()`` hands it the window's (scaled) gradient like every rank, and ``unscale_`` would fail on
    its missing scale. Scaling a zero (public ``scale()``) sets it to ``init_scale``, what every other rank set at
    its first ``scale()``; the ranks then update it alike, from the same reduced gradients.
    """

    @functools.wraps(original)
    def unscale_(scaler: Any, optimizer: Any) -> Any:
        params = optimizer_params(optimizer)
        if _live() and any(_indices(state, params) for _, state in _live()):
            params = before_clip("GradScaler.unscale_", params, can_finish=True)
            grads = [p.grad for p in params if p.grad is not None]
            if grads and scaler.is_enabled():
                scaler.scale(torch.zeros((), device=grads[0].device))  # sets a scale never set; else changes nothing
        return original(scaler, optimizer)

    unscale_.__gradagg_original__ = original  # type: ignore[attr-defined]
    return unscale_


def _noted_scaler_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.amp.GradScaler.step`` (``ShardedGradScaler``'s too: it inherits it): an attached optimizer's step as
    the scaler decided it. A step skipped for an inf or NaN (the scaler's business: the window is dropped, the scale
    backs off) runs no optimizer step hook, yet the window it finished is spent: marked like a step (see
    :func:`due`), so that the next window's first clip or step finishes without asking (:func:`_finish_due`)."""

    @functools.wraps(original)
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(scaler, optimizer, *args, **kwargs)
        note_step(optimizer)
        return out

    step.__gradagg_original__ = original  # type: ignore[attr-defined]
    return step


def _guarded_fsdp1_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    """FSDP1's own clip (``FullyShardedDataParallel.clip_grad_norm_``, a method): a clip over the module's parameters
    like ``torch.nn.utils``'s. Inside a window FSDP1's ``.grad`` shards hold the partial sums of the microbatches so
    far, not divided: a clip there would clip the wrong gradient."""

    @functools.wraps(original)
    def clip_grad_norm_(module: Any, *args: Any, **kwargs: Any) -> Any:
        before_clip("FullyShardedDataParallel.clip_grad_norm_", list(module.parameters()), can_finish=True)
        return original(module, *args, **kwargs)

    clip_grad_norm_.__gradagg_original__ = original  # type: ignore[attr-defined]
    return clip_grad_norm_


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
        scaler = torch.amp.GradScaler
        original_unscale = getattr(scaler.unscale_, "__gradagg_original__", scaler.unscale_)
        self.wrappers["GradScaler.unscale_"] = _guarded_unscale(original_unscale)
        scaler.unscale_ = self.wrappers["GradScaler.unscale_"]  # type: ignore[method-assign]
        original_step = getattr(scaler.step, "__gradagg_original__", scaler.step)
        self.wrappers["GradScaler.step"] = _noted_scaler_step(original_step)
        scaler.step = self.wrappers["GradScaler.step"]  # type: ignore[method-assign]
        self.handles = [
            register_optimizer_step_pre_hook(_step_pre_hook),
            register_optimizer_step_post_hook(_step_post_hook),
        ]

    def install_fsdp1(self) -> None:
        """Wrap FSDP1's own clip, and FSDP's ``ShardedGradScaler.unscale_`` (its own method: the wrapper on
        ``GradScaler``'s does not reach it), where the user imported them (never imported here: they are heavy)."""
        import sys

        scaler = getattr(sys.modules.get("torch.distributed.fsdp.sharded_grad_scaler"), "ShardedGradScaler", None)
        if scaler is not None and self.handles and "ShardedGradScaler.unscale_" not in self.wrappers:
            original_unscale = getattr(scaler.unscale_, "__gradagg_original__", scaler.unscale_)
            self.wrappers["ShardedGradScaler.unscale_"] = _guarded_unscale(original_unscale)
            scaler.unscale_ = self.wrappers["ShardedGradScaler.unscale_"]
        fsdp = sys.modules.get("torch.distributed.fsdp")
        cls = getattr(fsdp, "FullyShardedDataParallel", None)
        if cls is None or not self.handles or "FullyShardedDataParallel.clip_grad_norm_" in self.wrappers:
            return
        original = getattr(cls.clip_grad_norm_, "__gradagg_original__", cls.clip_grad_norm_)
        self.wrappers["FullyShardedDataParallel.clip_grad_norm_"] = _guarded_fsdp1_clip(original)
        cls.clip_grad_norm_ = self.wrappers["FullyShardedDataParallel.clip_grad_norm_"]

    def uninstall(self) -> None:
        import sys

        import torch.nn.utils.clip_grad as clip_module

        fsdp1_clip = self.wrappers.pop("FullyShardedDataParallel.clip_grad_norm_", None)
        cls = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
        if fsdp1_clip is not None and cls is not None and cls.clip_grad_norm_ is fsdp1_clip:
            cls.clip_grad_norm_ = fsdp1_clip.__gradagg_original__  # type: ignore[attr-defined]

        sharded = self.wrappers.pop("ShardedGradScaler.unscale_", None)
        scaler = getattr(sys.modules.get("torch.distributed.fsdp.sharded_grad_scaler"), "ShardedGradScaler", None)
        if sharded is not None and scaler is not None and scaler.unscale_ is sharded:
            scaler.unscale_ = sharded.__gradagg_original__  # type: ignore[attr-defined]
        unscale = self.wrappers.pop("GradScaler.unscale_", None)
        if unscale is not None and torch.amp.GradScaler.unscale_ is unscale:  # someone else's replacement stays
            torch.amp.GradScaler.unscale_ = unscale.__gradagg_original__  # type: ignore[attr-defined, method-assign]
        step = self.wrappers.pop("GradScaler.step", None)
        if step is not None and torch.amp.GradScaler.step is step:
            torch.amp.GradScaler.step = step.__gradagg_original__  # type: ignore[attr-defined, method-assign]
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
    "agree",
    "attach_optimizer",
    "before_clip",
    "check_step",
    "detach_optimizers",
    "due",
    "entry_of",
    "guarded_functions",
    "holder_of",
    "index_of",
    "note_step",
    "optimizer_params",
    "refuse_second",
    "register",
]
