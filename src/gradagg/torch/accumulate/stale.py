"""Gradients present when a window opens: zeros left by a zeroing are absent; anything else is refused.

``optimizer.zero_grad(set_to_none=False)`` (torchtitan's default while CUDA graphs are on) leaves every gradient
allocated and exactly zero. Such a gradient is no contribution: it is set to None as the window opens and the
window runs as after ``zero_grad()`` (adding an exact zero would not change the sum either). A gradient with any
other value (non-zero, NaN included) would be summed into the window's: the window is refused, on every rank.
The refusal is not raised where it is found: the rank that found it might be the only one that opens its window
before ``finish()`` (the others running no microbatch), and its peers would wait for it in their collectives.
It travels instead as the ``STALE`` status in the window's collective, so ``finish()`` raises on every rank,
naming the parameter on the rank that held it.
"""

from __future__ import annotations

import torch

from gradagg.torch.accumulate.state import State
from gradagg.torch.placements import local_tensor


def take_zeroed(state: State) -> str | None:
    """:func:`clear_zeroed` over the accumulator's parameters and the tensors the wrapper holds for them."""
    held = [(state.names[i], t) for i, t in enumerate(state.tensors)]
    held += [(state.names[i], t) for i, t in state.wrapper.held().items()]
    return clear_zeroed(held)


def clear_zeroed(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """Set every gradient present to None if all are exactly zero; else return the first non-zero one's name.

    The one rule, for the accumulator and the pipeline's. Checked on this rank's piece (an FSDP2 gradient's
    local shard: a DTensor's other shards live on other ranks, which check theirs). Nothing is changed when
    one is non-zero: the window will be refused.
    """
    held = [(name, t) for name, t in named if t.grad is not None]
    if not held:
        return None
    nonzero = _nonzero([local_tensor(t.grad) for _, t in held])  # type: ignore[arg-type]
    first = next((name for (name, _), nz in zip(held, nonzero) if nz), None)
    if first is None:
        for _, t in held:
            t.grad = None
    return first


def _nonzero(grads: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds anything but zeros (NaN is not zero): one device read per device, not per tensor."""
    out: list[bool] = [True] * len(grads)  # a sparse gradient is never taken for a zeroing's leftover
    by_device: dict[torch.device, list[int]] = {}
    for k, g in enumerate(grads):
        if g.layout == torch.strided:
            by_device.setdefault(g.device, []).append(k)
    for ks in by_device.values():
        flags = torch.stack([grads[k].detach().ne(0).any() for k in ks]).tolist()
        for k, flag in zip(ks, flags):
            out[k] = bool(flag)
    return out


HANDED, OUTSIDE = "handed", "outside"


def cause(state: State, name: str) -> str | None:
    """Why ``name`` holds a gradient as the window opens, where the accumulator can tell: ``HANDED`` (the very
    gradient the last ``finish()`` handed out, unchanged since), ``OUTSIDE`` (a backward outside ``microbatch()``
    reached a parameter), else None (the generic advice)."""
    if name in state.names:
        i = state.names.index(name)
        ref, handed_version = state.handed.get(i, (None, None))
        grad = state.tensors[i].grad
        now = None if grad is None else version(grad)
        if ref is not None and ref() is grad and now is not None and now == handed_version:
            return HANDED
    return OUTSIDE if state.window.outside is not None else None


def version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter: private (``Tensor._version``), read only to name a refusal; None where it is
    missing, and the refusal then gives the generic advice (no public API tells that a tensor was written in place,
    as ``zero_grad(set_to_none=False)`` and a write after it do)."""
    v = getattr(t, "_version", None)
    return v if isinstance(v, int) else None


def why(name: str, empty: bool, known: str | None = None) -> str:
    """The refusal's text on the rank that held the gradient (``known``: its :func:`cause`, if any)."""
    if known == HANDED:
        when = ("this rank ran no microbatch since: a second finish() for one window, or" if empty
                else "as the window opens: were")
        return (
            f"parameter {name!r} still holds the gradient the last finish() handed out, and {when} the gradients not "
            "zeroed after the step? Call finish() once per window and optimizer.zero_grad() after each step"
        )
    if known == OUTSIDE:
        return (
            f"parameter {name!r} has a gradient from before the window: a backward ran outside microbatch(), so no "
            "microbatch counts it; run each backward inside `with acc.microbatch(...)`"
        )
    where = "yet this rank ran no microbatch" if empty else "when the accumulation window opens"
    return (
        f"parameter {name!r} already has a non-zero gradient {where}: it would be summed into this window's; "
        "zero the gradients with optimizer.zero_grad() after each step (gradients zeroed in place count as absent)"
    )


__all__ = ["HANDED", "OUTSIDE", "cause", "clear_zeroed", "take_zeroed", "version", "why"]
