"""Worker functions for tests/torch/test_guard.py: clips and steps that would miss held gradients, on 2 ranks.

Rank 1 runs no microbatch in the first window and rank 0 none in the second: the ranks whose window is not
open must reach the same decision (finish, or raise) as the ones whose window is.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import dist as w

WINDOWS = [[2, 0], [0, 3]]  # microbatches of rank 0 and rank 1, per window
LR, CLIP = 0.5, 0.05  # CLIP below every window's norm here: the clip changes the step


def twin_steps(clip: float | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The plain loop on one process: each window's mean gradient over all its microbatches, clipped, a step."""
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for k, counts in enumerate(WINDOWS):
        batches = w.microbatches(sum(counts), seed=k + 1)
        for b in batches:
            (w.loss_of(model, b) / len(batches)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def run_window(acc: MicrobatchAccumulator, model: nn.Module, k: int) -> None:
    for b in w.my_share(WINDOWS[k], dist.get_rank(), seed=k + 1):
        with acc.microbatch():
            w.loss_of(model, b).backward()


def error(model: nn.Module, want: dict[str, torch.Tensor]) -> float:
    return max(float((p.detach() - want[n]).abs().max()) for n, p in model.named_parameters())


def attached_clip() -> dict[str, Any]:
    """Attached: clip_grad_norm_ finishes first on every rank (rank 1 ran nothing in window 1); the step
    pre-hook then finds the window finished. The result is the twin's clipped steps."""
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = MicrobatchAccumulator(model)
    acc.attach(opt)
    norms = []
    for k in range(len(WINDOWS)):
        run_window(acc, model, k)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    acc.close()
    want, want_norms = twin_steps(CLIP)
    return {"error": error(model, want), "norm_error": max(abs(a - b) for a, b in zip(norms, want_norms))}


def not_attached() -> dict[str, Any]:
    """Not attached: a clip or step before finish() raises on every rank, in window 1 (before any step) and
    window 2; a second step once both are finished (nothing held on any rank, .grad None) passes and moves
    nothing. Each refused window is then finished and stepped."""
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = MicrobatchAccumulator(model)
    out: dict[str, Any] = {}
    for k in range(len(WINDOWS)):
        run_window(acc, model, k)
        out[f"clip{k}"] = w.error_of(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        out[f"step{k}"] = w.error_of(opt.step)
        acc.finish()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # after finish: the exact gradient
        opt.step()
        opt.zero_grad()
    out["step_again"] = w.error_of(opt.step)
    acc.close()
    want, _ = twin_steps(CLIP)
    out["error"] = error(model, want)
    return out


def torchtitan_clip() -> dict[str, Any]:
    """torchtitan's dist_utils.clip_grad_norm_ (get_total_norm over [p.grad ...], then clip_grads_with_norm_), both
    ranks running microbatches: get_total_norm reads the held gradients' placeholders and raises on every rank,
    failing the window; the step is then refused on every rank until discard(); the next window steps."""
    try:
        from torchtitan.distributed import utils as dist_utils
    except ImportError:
        return {"skipped": True}
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = MicrobatchAccumulator(model)
    acc.attach(opt)
    for b in w.my_share([2, 1], dist.get_rank(), seed=1):
        with acc.microbatch():
            w.loss_of(model, b).backward()
    out = {"raised": w.error_of(lambda: dist_utils.clip_grad_norm_(model.parameters(), CLIP))}
    out["step"] = w.error_of(opt.step)  # the window was read: refused on every rank
    acc.discard()
    run_window(acc, model, 1)
    opt.step()  # a fresh window: the step finishes it
    out["divisor"] = acc.ledger.divisor
    acc.close()
    return out


def guard_world() -> dict[str, Any]:
    """Every case, then the originals back in torch.nn.utils once no accumulator is alive."""
    original = torch.nn.utils.clip_grad_norm_
    out = {"attached": attached_clip(), "not_attached": not_attached(), "torchtitan": torchtitan_clip()}
    gc.collect()
    out["restored"] = torch.nn.utils.clip_grad_norm_ is original
    return out


__all__ = ["guard_world", "twin_steps"]
