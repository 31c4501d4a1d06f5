"""The accumulator's flat buffer: every gradient, then the counters, in one tensor for one all_reduce."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from gradagg.torch._buffers import ReusableBuffer

NonFinite = Literal["propagate", "raise"]


@dataclass
class _Counts:
    per_rank: list[int]
    participation: list[int]
    status: list[float]
    nonfinite: list[int]


class _FlatLayout:
    """One flat buffer: every parameter's gradient, then the counters, in a dtype that holds them all.

    Layout: [grad_0 | grad_1 | ... | participation (P) | M per rank (W) | status per rank (W) |
    non-finite flag per rank (W)]. Counters are whole numbers; the buffer dtype is at least
    float32, which holds integers exactly up to 2**24 microbatches.
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device, world: int, nonfinite: NonFinite) -> None:
        self.params, self.device, self.world, self.nonfinite = params, device, world, nonfinite
        self.dtype = torch.float32
        for p in params:
            self.dtype = torch.promote_types(self.dtype, p.dtype)
        self.offsets, pos = [], 0
        for p in params:
            self.offsets.append(pos)
            pos += p.numel()
        self.total = pos
        self.size = pos + len(params) + 3 * world

    def zeros(self, pool: ReusableBuffer) -> torch.Tensor:
        return pool.get(self.size, self.dtype, self.device, zero=True)

    def slot(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)

    def viewable(self, i: int) -> bool:
        # autograd accumulates in place into an existing .grad only if it matches the parameter
        p = self.params[i]
        return p.dtype == self.dtype and p.device == self.device and p.is_contiguous()

    def install(self, pool: ReusableBuffer) -> torch.Tensor:
        """Zero buffer; parameters that can are given .grad views into it, so backward fills it in place."""
        flat = self.zeros(pool)
        for i, p in enumerate(self.params):
            if self.viewable(i):
                p.grad = self.slot(flat, i)
        return flat

    def pack(
        self, flat: torch.Tensor, params: list[torch.Tensor], part: list[int], m: int, rank: int, status: float
    ) -> None:
        for i, p in enumerate(params):
            slot = self.slot(flat, i)
            if p.grad is None or p.grad.data_ptr() == slot.data_ptr():
                continue  # absent (zeros already) or already in place
            slot.copy_(p.grad)  # another dtype or device, or autograd replaced the view
        meta = flat[self.total :]
        meta[: len(part)] = torch.tensor(part, dtype=self.dtype)
        w0 = len(part)
        meta[w0 + rank] = m
        meta[w0 + self.world + rank] = status
        if self.nonfinite == "raise":
            meta[w0 + 2 * self.world + rank] = 0.0 if _all_finite(flat[: self.total]) else 1.0

    def counts(self, flat: torch.Tensor) -> _Counts:
        meta = flat[self.total :].tolist()
        p, w = len(self.params), self.world
        return _Counts(
            per_rank=[round(v) for v in meta[p : p + w]],
            participation=[round(v) for v in meta[:p]],
            status=meta[p + w : p + 2 * w],
            nonfinite=[r for r, v in enumerate(meta[p + 2 * w :]) if v != 0],
        )

    def unpack(self, flat: torch.Tensor, params: list[torch.Tensor], part: list[int], m: int) -> None:
        flat[: self.total].div_(m)  # the divisor: counted microbatches on all ranks, one pass
        for i, p in enumerate(params):
            if part[i] == 0:
                p.grad = None  # absent in every microbatch on every rank
            elif self.viewable(i):
                p.grad = self.slot(flat, i)
            else:
                p.grad = self.slot(flat, i).to(p.device, p.dtype)


def _all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.is_floating_point() else True
