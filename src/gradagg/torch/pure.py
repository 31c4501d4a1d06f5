"""The slow, obviously right twin of :class:`~gradagg.torch.MicrobatchAccumulator`: the oracle of its tests.

Modelled on torchft's ``PureDistributedDataParallel``: no buckets, no hooks, no flat buffer, no overlap. At the
end of every microbatch each ``.grad`` is read (whatever put it there: backward, or a hand) and added, in
float64, to that parameter's sum; ``finish()`` sends one all_reduce per parameter (a presence flag and the sum)
and divides by the counted divisor D: M, or the exact sum of every weight of every rank (gathered, then
``math.fsum``). A parameter absent from every microbatch of every rank keeps ``grad is None``; one absent from
some contributes zeros there and still counts. Not for training: it is as slow as it looks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from gradagg.errors import WindowError


class PureAccumulator:
    """``p.grad`` = sum over all microbatches of all ranks of p's gradient / D (M, or the total weight).

    Args:
        params: plain tensors, in the same order on every rank (a replica of the model on every rank).
        group: a process group, or None for the default one; without a process group, one process.

    >>> w = torch.zeros(1, requires_grad=True)
    >>> pure = PureAccumulator([w])
    >>> for x, n in ((1.0, 1), (5.0, 3)):
    ...     with pure.microbatch(weight=n):
    ...         (w * x).sum().backward()
    >>> pure.finish(); w.grad  # (1 + 5) / (1 + 3)
    tensor([1.5000])
    """

    def __init__(self, params: Iterable[torch.Tensor], group: Any = None) -> None:
        self.params, self.group = list(params), group
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)
        self.m, self.weights = 0, list[float]()

    @contextlib.contextmanager
    def microbatch(self, weight: float | None = None) -> Iterator[None]:
        """One microbatch: whatever ``.grad`` holds when the ``with`` ends is its gradient."""
        yield
        for k, p in enumerate(self.params):
            if p.grad is not None:
                g = p.grad.detach().to(torch.float64)
                self.sums[k] = g.clone() if self.sums[k] is None else self.sums[k] + g  # type: ignore[operator]
                p.grad = None
        self.m += 1
        self.weights += [] if weight is None else [float(weight)]

    def finish(self) -> None:
        """Sum over ranks, one all_reduce per parameter, and divide by D (M, or the exact total weight)."""
        world = dist.is_initialized()
        gathered: list[object] = [(self.m, self.weights)]
        if world:
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, (self.m, self.weights), group=self.group)
        m = sum(g[0] for g in gathered)  # type: ignore[index]
        weights = [x for g in gathered for x in g[1]]  # type: ignore[index]
        divisor = math.fsum(weights) if weights else m
        if divisor == 0:
            raise WindowError(f"no mean to take: D = 0 (M = {m}, weights {weights})")
        for k, p in enumerate(self.params):
            s = self.sums[k]
            flat = torch.zeros(1 + p.numel(), dtype=torch.float64)
            if s is not None:
                flat[0], flat[1:] = 1.0, s.reshape(-1)
            if world:
                dist.all_reduce(flat, group=self.group)
            p.grad = None if flat[0] == 0 else (flat[1:] / divisor).reshape(p.shape).to(p.dtype)
        self.sums, self.m, self.weights = [None] * len(self.params), 0, []


__all__ = ["PureAccumulator"]
