"""The data-parallel sum and the division: every replica of a stage ends with (sum over replicas) / D."""

from __future__ import annotations

import torch

from gradagg.torch.collectives import Group, all_reduce_sum, device_for


def reduce_and_divide(params: list[torch.Tensor], present: tuple[bool, ...], divisor: float, dp: Group) -> None:
    """All_reduce the gradients of ``params`` over ``dp`` (one call per dtype), then divide them by ``divisor``.

    A parameter present on some replica but not here is written as zeros (its absence here contributes
    nothing, and the collective's layout must be the same on every replica); one absent on every replica
    stays None. The division comes after the sum, by the counted D, once: never a mean of means.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p, here in zip(params, present):
        if here:
            by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, group in by_dtype.items():
        _reduce(group, dtype, divisor, dp)


def _reduce(params: list[torch.Tensor], dtype: torch.dtype, divisor: float, dp: Group) -> None:
    device = device_for(dp)
    flat = torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p, dtype=dtype)).reshape(-1).to(device)
        for p in params
    ])
    all_reduce_sum(flat, dp)
    flat.div_(divisor)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].reshape(p.shape).to(p.device)
        offset += n
