"""FSDP2's ``every_microbatch`` form: the shards FSDP reduced after each microbatch, summed here and divided once.

FSDP would add each microbatch's shard into ``.grad`` in the parameter's dtype: for bf16 parameters a sum of
M microbatches in bf16 (256 + 1 rounds to 256). Here the sum is kept in float32 at least, and ``.grad``
stays None until ``finish()``. FSDP calls the sharded parameter's post-accumulate-grad hooks after each
reduce (for optimizers in backward); where it does not (compiled autograd), it keeps the sum in ``.grad``:
:func:`shard_mean` folds that in, and :func:`kept_by_fsdp` refuses it in bf16 or fp16. Participation is
counted on the unsharded parameter (:func:`gradagg.torch.accumulate.hooks.on_grad`).
"""

from __future__ import annotations

import torch

from gradagg.torch.accumulate.fsdp import low_precision
from gradagg.torch.accumulate.state import State
from gradagg.torch.placements import local_tensor


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(dtype=torch.promote_types(torch.float32, t.dtype), copy=True)


def on_shard(state: State, i: int, param: torch.Tensor) -> None:
    """FSDP just reduce-scattered a microbatch into the sharded ``param.grad``: add it to the window's sum."""
    grad = param.grad
    w = state.window
    if grad is None or not w.open:
        return  # before any window: left in .grad, so the next window refuses it as stale
    local = local_tensor(grad)
    total = w.shard_sums.get(i)
    if total is None:
        w.shard_sums[i] = _wide(local)
    else:
        total.add_(local.detach())
    param.grad = None


def shard_mean(state: State, i: int, t: torch.Tensor, divisor: float) -> torch.Tensor | None:
    """Parameter ``i``'s summed shards divided by D, as a DTensor gradient (None if none)."""
    total = state.window.shard_sums.pop(i, None)
    if t.grad is not None:  # FSDP summed (some of) it into .grad itself: its hook did not run
        kept = local_tensor(t.grad)
        total = _wide(kept) if total is None else total.add_(kept.detach())
    if total is None or state.fsdp is None:
        return None
    if divisor != 1:
        total.div_(divisor)
    return state.fsdp.sharded_grad(t, total)


def kept_by_fsdp(state: State) -> str | None:
    """Why a shard FSDP summed into ``.grad`` itself cannot count (a bf16 or fp16 sum), or None."""
    if not state.every_microbatch():
        return None
    for i in sorted(state.sharded):
        g = state.tensors[i].grad
        if g is not None and low_precision(g.dtype):
            return (
                f"parameter {state.names[i]!r}: FSDP summed microbatches into its {g.dtype} .grad itself (its "
                "post-accumulate-grad hooks did not run, e.g. under compiled autograd); use fsdp='window'"
            )
    return None


__all__ = ["kept_by_fsdp", "on_shard", "shard_mean"]
