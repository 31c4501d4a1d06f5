"""Worker functions for tests/torch/test_held.py: a clip imported by name before any accumulator, on 2 ranks.

A rank that ran microbatches holds placeholders in ``.grad`` (see gradagg.torch.held): the clip raises there and
fails the window; a rank that ran none reads None (no gradient, norm 0) and learns of the refusal in finish().
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad_norm_  # this module is imported before the worker builds an accumulator

from gradagg.errors import GradaggError
from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import dist as w

# a process where an accumulator was alive at import (pytest's) bound the guard's wrapper: take what it wraps
CLIP = getattr(clip_grad_norm_, "__gradagg_original__", clip_grad_norm_)
WINDOWS = [[2, 0], [1, 2], [2, 0]]  # microbatches of rank 0 and rank 1, per window
LR, MAX = 0.5, 0.05


def _outcome(fn: Any) -> list[Any]:
    try:
        value = fn()
    except GradaggError as exc:
        return [type(exc).__name__, str(exc)]
    return ["value", float(value) if isinstance(value, torch.Tensor | float) else None]


def _window(acc: MicrobatchAccumulator, model: torch.nn.Module, k: int) -> None:
    for b in w.my_share(WINDOWS[k], dist.get_rank(), seed=k + 1):
        with acc.microbatch():
            w.loss_of(model, b).backward()


def early_clip_world() -> dict[str, Any]:
    """Windows 0 and 1: the early clip before finish() (refused), finish() (refused on both), discard(). Window 2:
    finish() first, then the early clip and a step: the same as the plain loop's on one process."""
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = MicrobatchAccumulator(model)
    out: dict[str, Any] = {"rank": dist.get_rank()}
    for k in (0, 1):
        _window(acc, model, k)
        out[f"clip{k}"] = _outcome(lambda: CLIP(model.parameters(), MAX))
        finished = _outcome(acc.finish)
        out[f"finish{k}"] = None if finished[0] == "value" else finished
        acc.discard()
    _window(acc, model, 2)
    acc.finish()
    norm = float(CLIP(model.parameters(), MAX))
    opt.step()
    acc.close()
    twin, twin_opt = w.TinyMoE(), None
    twin_opt = torch.optim.SGD(twin.parameters(), lr=LR)
    batches = w.microbatches(sum(WINDOWS[2]), seed=3)
    for b in batches:
        (w.loss_of(twin, b) / len(batches)).backward()
    want = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX))
    twin_opt.step()
    out["norm_error"] = abs(norm - want)
    out["error"] = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), twin.parameters()))
    return out


def early_clip_stops() -> None:
    """Counts [2, 0]: rank 0's clip raises and the rank stops there; rank 1 (which read nothing) goes on to
    finish(), whose collective fails with CollectiveError instead of waiting for ever."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    _window(acc, model, 0)
    CLIP(model.parameters(), MAX)
    acc.finish()


__all__ = ["WINDOWS", "early_clip_stops", "early_clip_world"]
