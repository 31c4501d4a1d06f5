"""Opening a window: check the parameters (against the other ranks, once), let the wrapper open, allocate."""

from __future__ import annotations

import torch

from gradagg.errors import GradaggError
from gradagg.torch import guard
from gradagg.torch.accumulate import stale
from gradagg.torch.accumulate.buckets import Sender
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.window import CHANGED, STALE
from gradagg.torch.collectives import check_same_on_all_ranks
from gradagg.torch.placements import dtype_name


def open_window(state: State, *, empty: bool = False) -> None:
    """Open a window: check the parameters, let the wrapper open (FSDP2 unshards), allocate the buffer.

    Gradients present as it opens are a zeroing's leftovers if exactly zero (set to None), else a stale
    contribution: the window is refused in ``finish()``, on every rank (see :mod:`.stale`).

    Args:
        state: the accumulator.
        empty: opened by ``finish()`` on a rank that ran no microbatch.

    Raises:
        CollectiveError: the ranks accumulate different parameters (every rank).
        GradaggError: unnamed parameters that cannot be told apart across ranks (every rank).
    """
    w = state.window
    check_params(state)
    check_layout(state)
    held = stale.take_zeroed(state)
    if held is not None:
        w.fail(STALE, stale.why(held, empty, stale.cause(state, held)))
    w.open = True
    state.wrapper.open(state)
    groups = state.wrapper.groups(state.group)
    layout = state.layout()
    w.flat = layout.fresh(state.pools[0])
    w.out = layout.output(state.pools[1])
    w.sender = Sender(layout, w.flat, w.out, groups, state.nonfinite == "raise", w.written)


def install(state: State) -> None:
    """Register the accumulator with :mod:`gradagg.torch.guard` (steps and clips that would miss its gradients);
    compare the parameters with the other ranks' (:func:`check_layout`); let the wrapper hook the parameters."""
    state.extra_hooks.append(guard.register(state))
    check_layout(state)
    state.wrapper.install(state)


def check_params(state: State) -> None:
    """Poison the window if the trainable parameters are no longer the accumulated ones."""
    changed = state.params.changed()
    if changed is not None:
        state.window.fail(CHANGED, changed + "; build a new accumulator after changing requires_grad")


def check_layout(state: State) -> None:
    """Every rank must lay out the same parameters in the same order, or the sums would mix them.

    Done at construction, where every rank is: the accumulator's first collective on every rank. (Done when the
    first window opened, it met another accumulator's collective on a rank whose first window opened later, one
    with no microbatch of it: with several accumulators per process the ranks' collectives then paired wrongly.)
    Named parameters are compared by name, shape and dtype. Unnamed ones (bare tensors) are matched by
    position, so their values are compared too (replicas hold the same values): tensors given in another
    order on another rank are refused, and two unnamed tensors that nothing tells apart (same shape,
    dtype and values) are refused on every rank, since a reordering of them could not be seen.

    Raises:
        CollectiveError: the ranks' parameters differ (every rank, naming both).
        GradaggError: indistinguishable unnamed parameters in a group of more than one rank (every rank).
    """
    if state.layout_checked:
        return
    distributed = state.world > 1
    unnamed = state.params.unnamed if distributed else set()
    entries: list[tuple[object, str]] = []
    for i, (n, t) in enumerate(zip(state.names, state.tensors)):
        values = f", values {fingerprint(t)}" if i in unnamed else ""
        entries.append((n, f"(shape={state.params.shape_text(i)}, dtype={dtype_name(t.dtype)}{values})"))
    what = "accumulated parameters"
    if state.terms:  # the loss terms' sums are divided in this order on every rank
        entries.append(("loss terms (terms=)", repr(state.terms)))
        what += " and loss terms"
    if unnamed:
        what += " (bare tensors are matched by position and values: pass (name, tensor) pairs or the module)"
    check_same_on_all_ranks(entries, what, state.group)
    _refuse_twins([entries[i] for i in sorted(unnamed)])
    state.layout_checked = True


def _refuse_twins(entries: list[tuple[object, str]]) -> None:
    first: dict[str, object] = {}
    for name, description in entries:
        if description in first:
            raise GradaggError(
                f"parameters {first[description]!r} and {name!r} are bare tensors with the same shape, dtype and "
                f"values {description}: given in another order on another rank they would mix silently; pass "
                "(name, tensor) pairs (model.named_parameters()) or the module"
            )
        first[description] = name


_CHUNK = 1 << 20  # int64 lanes hashed at a time: bounded memory whatever the tensor's size


def fingerprint(t: torch.Tensor) -> str:
    """An exact digest of ``t``'s bytes, the same on any device: a 64-bit multiply-add hash in int64 lanes.

    Integer sums wrap and are associative, so every device and reduction order gives the same bits (a float
    checksum would not). Run once per accumulator, on unnamed parameters in a process group only.

    >>> a, b = torch.zeros(3), torch.ones(3)
    >>> fingerprint(a) == fingerprint(a.clone()), fingerprint(a) == fingerprint(b)
    (True, False)
    """
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
    pad = -raw.numel() % 8
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    lanes = raw.view(torch.int64)
    g = torch.Generator().manual_seed(0x9E3779B97F4A7C15 & (2**63 - 1))
    h = lanes.numel()
    for start in range(0, lanes.numel(), _CHUNK):
        part = lanes[start : start + _CHUNK]
        mult = torch.randint(-(2**63), 2**63 - 1, (part.numel(),), generator=g, dtype=torch.int64) | 1
        h = (h * 0x100000001B3 + int((part * mult.to(part.device)).sum())) % 2**64
    return f"{h:016x}"


__all__ = ["check_layout", "check_params", "fingerprint", "install", "open_window"]
