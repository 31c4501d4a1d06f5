"""The slow, obviously right twin of :class:`~gradagg.torch.MicrobatchAccumulator`: the oracle of its tests.

Modelled on torchft's ``PureDistributedDataParallel``: no buckets, no hooks, no flat buffer, no overlap. At the
end of every microbatch each ``.grad`` is read (whatever put it there: backward, or a hand) and added, in
float64, to that parameter's sum; ``finish()`` sends one all_reduce per parameter (a presence flag and the sum)
and divides by the counted divisor D: M, or the exact sum of every weight of every rank (gathered, then
``math.fsum``). A parameter absent from every microbatch of every rank keeps ``grad is None``; one absent from
some contributes zeros there and still counts. Not for training: it is as slow as it looks.

With ``terms=``, the twin of loss terms counted as the window runs: each ``mb.backward(term, loss, count)`` moves
its gradients into that term's own float64 sums, and ``finish()`` gives ``sum over terms of (sum over ranks) / D_k``,
D_k the term's counts gathered from every rank and added with ``math.fsum``.
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
    >>> w.grad = None; twin = PureAccumulator([w], terms=("a", "b"))
    >>> with twin.microbatch() as mb:
    ...     mb.backward("a", 6 * w.sum(), count=3)
    ...     mb.backward("b", 8 * w.sum())
    >>> twin.count("b", 4); twin.finish(); w.grad  # 6 / 3 + 8 / 4
    tensor([4.])
    """

    def __init__(self, params: Iterable[torch.Tensor], group: Any = None, terms: Iterable[str] = ()) -> None:
        self.params, self.group, self.terms = list(params), group, tuple(terms)
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)
        self.m, self.weights = 0, list[float]()
        self.term_sums: dict[str, list[torch.Tensor | None]] = {t: [None] * len(self.params) for t in self.terms}
        self.counts = {t: list[float]() for t in self.terms}

    @contextlib.contextmanager
    def microbatch(self, weight: float | None = None) -> Iterator[PureAccumulator]:
        """One microbatch: whatever ``.grad`` holds when the ``with`` ends is its gradient; it yields the twin itself,
        whose :meth:`backward` runs a loss term's backward."""
        yield self
        self._take(self.sums)
        self.m += 1
        self.weights += [] if weight is None else [float(weight)]

    def _take(self, sums: list[torch.Tensor | None]) -> None:
        for k, p in enumerate(self.params):
            if p.grad is not None:
                g = p.grad.detach().to(torch.float64)
                sums[k] = g.clone() if sums[k] is None else sums[k] + g  # type: ignore[operator]
                p.grad = None

    def backward(self, term: str, loss: torch.Tensor, count: float | None = None, *, retain_graph: bool = False
                 ) -> None:
        """Loss term ``term``'s backward, its gradients into the term's sums; ``count`` added to its count."""
        loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
        self._take(self.term_sums[term])
        self.count(term, 0.0 if count is None else count)

    def count(self, term: str, n: float) -> None:
        """Add ``n`` to this rank's count of ``term``."""
        self.counts[term].append(float(n))

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
        if self.terms:
            return self._finish_terms(world)
        if divisor == 0:
            raise WindowError(f"no mean to take: D = 0 (M = {m}, weights {weights})")
        for k, p in enumerate(self.params):
            total = self._reduce(self.sums[k], p, world)
            p.grad = None if total is None else (total / divisor).reshape(p.shape).to(p.dtype)
        self.sums, self.m, self.weights = [None] * len(self.params), 0, []

    def _reduce(self, s: torch.Tensor | None, p: torch.Tensor, world: bool) -> torch.Tensor | None:
        """The sum over ranks of one parameter's sum (None where no rank has one): a presence flag rides along."""
        flat = torch.zeros(1 + p.numel(), dtype=torch.float64)
        if s is not None:
            flat[0], flat[1:] = 1.0, s.reshape(-1)
        if world:
            dist.all_reduce(flat, group=self.group)
        return None if flat[0] == 0 else flat[1:]

    def _finish_terms(self, world: bool) -> None:
        gathered: list[object] = [self.counts]
        if world:
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, self.counts, group=self.group)
        totals = {t: math.fsum(x for g in gathered for x in g[t]) for t in self.terms}  # type: ignore[index]
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for t in self.terms:
            for k, p in enumerate(self.params):
                total = self._reduce(self.term_sums[t][k], p, world)
                if total is not None and totals[t] == 0 and bool(total.ne(0).any()):
                    raise WindowError(f"loss term {t!r} counts 0 but has a non-zero gradient")
                if total is not None:
                    part = total / totals[t] if totals[t] else total
                    grads[k] = part if grads[k] is None else grads[k] + part  # type: ignore[operator]
        for p, g in zip(self.params, grads):
            p.grad = None if g is None else g.reshape(p.shape).to(p.dtype)
        self.term_sums = {t: [None] * len(self.params) for t in self.terms}
        self.counts, self.m = {t: [] for t in self.terms}, 0


__all__ = ["PureAccumulator"]
