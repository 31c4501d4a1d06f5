"""A held gradient's ``.grad``: a placeholder that refuses whatever reads it, whatever name the reader holds.

Between the microbatches of an open window every counted gradient sits in the accumulator's buffer (see
:mod:`gradagg.torch.accumulate.hooks`). Left None, ``.grad`` would read as "no gradient" to anything that got past
:mod:`gradagg.torch.guard`'s replaced functions: a ``clip_grad_norm_`` imported by name before the first accumulator
was built, a ``functools.partial`` of it, ``torch.nn.utils.get_total_norm``, ``torch._foreach_norm`` or
``p.grad.norm()`` by hand. Each would clip nothing and return 0, silently. So between microbatches the
accumulator's own parameters (plain tensors whose ``.grad`` it takes) hold a :class:`HeldGradient` instead: a tensor
of the parameter's shape, dtype and device with no storage, whose every torch operation comes to
:meth:`HeldGradient.__torch_dispatch__`, below every Python name:

* an operation that reads it (a norm, a clamp, a scaling, an optimizer's update) raises
  :class:`~gradagg.errors.WindowError` and fails the window (status ``READ``): ``finish()`` then refuses on every
  rank, and so does every clip or step the guard agrees on (:func:`gradagg.torch.guard.agree`), until ``discard()``.
  A rank that ran no microbatch holds no placeholder (its ``.grad`` is None, its read sees nothing): it learns of the
  refusal at its next collective of the window, the finish or a guarded clip or step; a rank that stops on the
  error instead leaves the others a :class:`~gradagg.errors.CollectiveError` there, within the collective timeout;
* zeroing it (``zero_grad(set_to_none=False)``) does nothing, as zeroing a None ``.grad`` did;
* adding into it (a backward outside ``microbatch()``, autograd's accumulation; ``p.grad += g`` by hand) fails the
  window as a gradient outside a microbatch does;
* setting ``.grad`` replaces it (a gradient set by hand between microbatches is refused as before).

Under FSDP2 (parameters held as shards) no placeholder is set: a shard's ``.grad`` is FSDP's own, and the
padding rounds of its shards form run backwards between microbatches; there only the guard's replaced
functions and step hooks refuse.

Inside a microbatch ``.grad`` is None until a backward's gradient is taken, then the placeholder again; a
tensor hook (which autograd runs before it accumulates into ``.grad``) lifts it for the next backward of the
microbatch, so several backwards in one microbatch still sum. A clip by a name taken early is refused there too.
It is made with ``torch.Tensor._make_wrapper_subclass`` (private, the way torch's own tensor subclasses such as
DTensor are made); where a torch lacks it, no placeholder is set and only the guard's replaced functions refuse.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from gradagg.errors import WindowError
from gradagg.torch.accumulate.window import OUTSIDE, READ

if TYPE_CHECKING:
    from gradagg.torch.accumulate.state import State

AVAILABLE = hasattr(torch.Tensor, "_make_wrapper_subclass")
_ZEROING = {"aten::zero_", "aten::_foreach_zero_", "aten::detach_"}
_ADDING = {"aten::add_", "aten::add"}


class HeldGradient(torch.Tensor):
    """The ``.grad`` of an accumulator's parameter ``param`` (its index), between microbatches (see the module
    docstring); ``held_by`` is the accumulator's state, weakly."""

    held_by: weakref.ReferenceType[State]
    param: int

    @staticmethod
    def __new__(cls, like: torch.Tensor, state: State, index: int) -> HeldGradient:  # noqa: PYI034
        held = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device, requires_grad=False
        )
        held.held_by, held.param = weakref.ref(state), index
        return held  # type: ignore[no-any-return]

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # straight to dispatch

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Iterable[type], args: tuple[Any, ...] = (), kwargs: dict[Any, Any] | None = None
    ) -> Any:
        return _dispatch(func, list(args), kwargs or {})

    def __repr__(self, *_: object, **__: object) -> str:  # type: ignore[override]
        return f"HeldGradient(shape={tuple(self.shape)}, dtype={self.dtype}: held by the accumulator until finish())"


def _dispatch(func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    name = func._schema.name  # e.g. "aten::linalg_vector_norm"
    first = next(a for a in _flat([*args, *kwargs.values()]) if isinstance(a, HeldGradient))
    if name in _ZEROING:  # zero_ and detach_ return the tensor; _foreach_zero_ returns nothing
        return None if name == "aten::_foreach_zero_" else args[0]
    state = first.held_by()
    if name in _ADDING and args and args[0] is first:
        if state is not None and state.window.open:
            param = state.names[first.param]
            state.window.fail(OUTSIDE, f"parameter {param!r} got a gradient outside microbatch() (not counted in M)")
        return args[0] if name == "aten::add_" else args[1]
    raise refusal(state, first.param, name)


def refusal(state: State | None, index: int, what: str) -> WindowError:
    """The error of a read of a held gradient, the window failed (status ``READ``) so that every rank refuses."""
    if state is None:
        return WindowError(f"{what} read a gradient of an accumulator that no longer exists")
    why = (
        f"{what} read the gradient of parameter {state.names[index]!r}, which {state.label()} still holds (a window "
        "is open: the gradient is in its buffer until finish(), so a norm, clip or step now would see none)"
    )
    state.window.fail(READ, why)
    return WindowError(
        f"rank {state.rank}: {why}; the window is refused on every rank (discard() it); call acc.finish() before "
        "reading gradients, or acc.attach(optimizer) and clip through torch.nn.utils: the clip then finishes first"
    )


def _flat(values: list[Any]) -> list[Any]:
    """The arguments, lists and tuples of them opened (a foreach operation takes lists of tensors)."""
    return [x for v in values for x in (v if isinstance(v, list | tuple) else (v,))]


class Veil:
    """The placeholders of one accumulator's parameters: :meth:`put` between microbatches, :meth:`lift` before
    anything of the accumulator's own reads ``.grad`` (a microbatch, ``finish()``, ``discard()``, ``close()``)."""

    def __init__(self) -> None:
        self.placed: dict[int, tuple[weakref.ReferenceType[torch.Tensor], HeldGradient]] = {}

    def put(self, state: State) -> None:
        """Set the placeholder as the ``.grad`` of each plain parameter whose ``.grad`` is None (window open)."""
        if not AVAILABLE or state.sharded or not state.window.open or state.window.in_microbatch:
            return  # FSDP2: the shards' .grad and its padding rounds' backwards are FSDP's; not veiled
        for i, t in state.taken:
            self.put_one(state, i, t)

    def put_one(self, state: State, i: int, t: torch.Tensor) -> None:
        """The placeholder into parameter ``i``'s ``.grad`` if it is None: between microbatches (:meth:`put`), and
        inside one once a backward's gradient was taken (:mod:`gradagg.torch.accumulate.hooks`; its tensor hook
        lifts the placeholder before autograd accumulates the next backward's)."""
        if not AVAILABLE or state.sharded or t.grad is not None or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return  # FSDP2 and DTensors: their .grad is theirs (see the module docstring)
        if i not in self.placed:
            self.placed[i] = (weakref.ref(t), HeldGradient(t, state, i))
        t.grad = self.placed[i][1]

    def lift(self) -> None:
        """Set back to None every ``.grad`` that is still this accumulator's placeholder."""
        for ref, held in self.placed.values():
            t = ref()
            if t is not None and t.grad is held:
                t.grad = None


def is_held(t: object) -> bool:
    """Whether ``t`` (a ``.grad``) is a held gradient's placeholder."""
    return isinstance(t, HeldGradient)


__all__ = ["AVAILABLE", "HeldGradient", "Veil", "is_held", "refusal"]
