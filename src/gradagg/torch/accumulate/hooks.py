"""The hooks: each microbatch's gradient moved into the window's flat buffer, ``.grad`` left None.

The heart of the accumulator: after autograd accumulated a microbatch's gradient into ``param.grad``, a
post-accumulate-grad hook (public ``Tensor.register_post_accumulate_grad_hook``) adds it into the buffer and
sets ``param.grad = None``, so nothing outside the accumulator (``zero_grad()``, a clip) can change a
counted gradient during the window, and under FSDP2 the unsharded gradient never reaches FSDP. The wrapper
(:mod:`.seam`) says which tensors to hook; these are the hooks' work. A ``.grad``
the user sets by hand inside a microbatch is taken the same way when the microbatch ends
(:func:`take_hand_set`): it counts in that microbatch, as it would in a plain loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import cast

import torch

from gradagg.torch import guard, held
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.window import HAND_SET, LATE, NO_TERM, OUTSIDE, TERM, UNSUPPORTED, Into

OnGrad = Callable[[State, int, torch.Tensor], None]


def hook(state: State, t: torch.Tensor, i: int, on: OnGrad) -> None:
    """Register ``on(state, i, t)`` as ``t``'s post-accumulate-grad hook (once per tensor)."""
    if id(t) in state.hooked:
        return

    def after_accumulate(param: torch.Tensor) -> None:
        on(state, i, param)

    state.hooked[id(t)] = (t, t.register_post_accumulate_grad_hook(after_accumulate))  # type: ignore[no-untyped-call]
    if held.AVAILABLE and not state.sharded and t.requires_grad and t.grad_fn is None:
        # a leaf that may hold a placeholder (see gradagg.torch.held): its tensor hooks run before autograd
        # accumulates into .grad, so the placeholder set after the previous backward's gradient was taken is
        # lifted first, and this backward's gradient lands in an empty .grad, as without it
        ref = weakref.ref(t)
        state.extra_hooks.append(t.register_hook(lambda grad: _lift(ref())))  # type: ignore[no-untyped-call]


def _lift(t: torch.Tensor | None) -> None:
    if t is not None and held.is_held(t.grad):
        t.grad = None


def on_grad(state: State, i: int, param: torch.Tensor) -> None:
    """A gradient for parameter ``i`` was just accumulated into ``param.grad``: take it into the buffer."""
    w = state.window
    if not w.in_microbatch:
        if w.open:
            w.fail(OUTSIDE, f"parameter {state.names[i]!r} got a gradient outside microbatch() (not counted in M)")
        elif w.outside is None:  # left in .grad: the opening refuses it, and names this as the cause
            w.outside = state.names[i]
        return
    grad = param.grad
    if state.takes(i) and grad is not None and w.flat is not None and w.sender is not None:
        if grad.layout != torch.strided:
            w.fail(UNSUPPORTED, f"parameter {state.names[i]!r} got a {grad.layout} gradient; only dense ones count")
        elif w.sender.sent(i):
            w.fail(
                LATE,
                f"parameter {state.names[i]!r} got a gradient after its bucket was sent "
                "(a second backward in the microbatch marked last, or a .grad set by hand after it?)",
            )
        elif w.into is None:
            layout = state.layout()
            first = layout.copies_first() and i not in w.written
            if torch.is_grad_enabled():  # a backward with create_graph=True: the buffer must stay out of the graph
                with torch.no_grad():
                    layout.add(w.flat, i, grad, first=first)
            else:  # autograd runs the hooks of a plain backward with grad mode off already
                layout.add(w.flat, i, grad, first=first)
            w.written.add(i)
        else:  # loss terms: into the running term's own sum
            add_term(state, i, grad, w.into)
        param.grad = None
        guard.veil_one(state, i, param)  # a read before the microbatch ends is refused, whatever name it comes by
    w.seen.add(i)
    if w.in_last and w.sender is not None:
        w.sender.ready(i)


def add_term(state: State, i: int, grad: torch.Tensor, into: Into) -> None:
    """The hook's path with loss terms (see :mod:`.terms_after`): the gradient into the running term's sum."""
    w = state.window
    if into is NO_TERM:
        w.fail(TERM, f"parameter {state.names[i]!r} got a gradient in microbatch {w.m} outside mb.backward(term, ...) "
                     "(a plain backward, or a .grad set by hand): with loss terms, every backward names its term")
        return
    layout = state.layout()
    with torch.no_grad():
        if into.buf is None:  # the rank's first term: the window's own buffer, as without terms
            layout.add(cast(torch.Tensor, w.flat), i, grad, first=layout.copies_first() and i not in w.written)
            w.written.add(i)
        else:  # a zeroed buffer of its own
            layout.add(into.buf, i, grad)


def hooked_grads(state: State) -> list[tuple[int, torch.Tensor]]:
    """The tensors whose ``.grad`` the accumulator takes (the parameters neither held as shards nor reduced by the
    wrapper, and the tensors the wrapper holds for them: FSDP2's unsharded ones) that hold one now."""
    out = [(i, t) for i, t in state.taken if t.grad is not None and not held.is_held(t.grad)]
    return out + [(i, t) for i, t in state.wrapper.held().items() if state.takes(i) and t.grad is not None]


def take_hand_set(state: State) -> None:
    """At a microbatch's end: a ``.grad`` still present was set by hand in it; count it there, like a backward's.

    Where the wrapper cannot add it to the window (a shard's ``.grad`` under FSDP2), the wrapper refuses it.
    """
    for i, t in hooked_grads(state):
        on_grad(state, i, t)
    state.wrapper.refuse_hand_set(state)


def refuse_hand_set(state: State, where: str) -> None:
    """Outside a microbatch of an open window no ``.grad`` may be present: it could count in no microbatch."""
    present = hooked_grads(state)
    if present:
        name = state.names[present[0][0]]
        state.window.fail(HAND_SET, f"parameter {name!r} has a .grad set by hand {where}: no microbatch counts it")


__all__ = ["add_term", "hook", "hooked_grads", "on_grad", "refuse_hand_set", "take_hand_set"]
