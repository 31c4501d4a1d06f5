"""Sending a window's buckets: in one fixed order on every rank, early ones during the last backward.

Every rank issues the same collectives in the same order (bucket 0, 1, ..., the last one with the
counters), so ranks that ran different numbers of microbatches, none included, still match: only the
*timing* differs. In the microbatch marked last, a bucket is sent as soon as all its parameters got their
gradient and every earlier bucket was sent (as DDP's reducer does), so communication overlaps the rest
of the backward; whatever is left is sent by ``finish()``. The last bucket always waits for ``finish()``,
because the counters of the last microbatch are known only when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradagg.torch.accumulate.flat import FlatLayout, all_finite
from gradagg.torch.collectives import Group, Pending, all_reduce_sum_async, reduce_scatter_sum_async


@dataclass(frozen=True)
class Groups:
    """Where each kind of bucket is reduced: the accumulator's group; FSDP's shard and replicate groups."""

    world: Group = None
    shard: Group = None
    replicate: Group = None


class Sender:
    """The buckets of one window in flight.

    Args:
        layout: the buckets.
        flat: the window's input buffer; ``out`` receives the reduce-scatter segments.
        groups: the process groups.
        check_finite: also compute, before each bucket leaves, whether this rank's sums are finite.
    """

    def __init__(
        self,
        layout: FlatLayout,
        flat: torch.Tensor,
        out: torch.Tensor | None,
        groups: Groups,
        check_finite: bool,
        written: set[int],
    ) -> None:
        self.layout, self.flat, self.out, self.groups = layout, flat, out, groups
        self.written = written  # parameters whose slot holds this window's gradient (the others are zeroed)
        self.next = 0  # buckets [0, next) are sent
        self.left = [len(b.params) for b in layout.buckets]
        self.ready_params: set[int] = set()
        self.pending: list[Pending] = []
        self.finite: torch.Tensor | None = None  # this rank's sums all finite so far (with nonfinite="raise")
        if check_finite:
            self.finite = torch.ones((), dtype=torch.bool, device=flat.device)

    def sent(self, i: int) -> bool:
        """Whether parameter ``i``'s bucket already left (a later gradient for it would be lost)."""
        b = self.layout.slots[i].bucket
        return 0 <= b < self.next

    def ready(self, i: int) -> None:
        """Parameter ``i`` got its gradient in the last microbatch: send every bucket that is now complete."""
        b = self.layout.slots[i].bucket
        if i in self.ready_params or b < 0:
            return
        self.ready_params.add(i)
        self.left[b] -= 1
        while self.next < len(self.left) - 1 and self.left[self.next] <= 0:
            self._send(self.next)

    def flush(self, counters: list[float]) -> None:
        """Send every bucket not sent yet, the last one with this rank's ``counters``."""
        last = len(self.layout.buckets) - 1
        while self.next < last:
            self._send(self.next)
        self._zero_unwritten(last)
        if self.finite is not None:
            self.finite &= all_finite(self.layout.segments(self.flat, last)[:, self.layout.n_counters :])
        nonfinite = None if self.finite is None else ~self.finite
        self.layout.write_counters(self.flat, counters, nonfinite)
        self._send(last)

    def wait(self) -> None:
        """Wait for every bucket; on HSDP then all-reduce the received shards over the replicas, in order.

        Raises:
            CollectiveError: a collective failed or timed out.
        """
        for p in self.pending:
            p.wait()
        self.pending = []
        if self.groups.replicate is None:
            return
        replicas = [
            all_reduce_sum_async(self.layout.received(self.flat, self.out, b), self.groups.replicate)
            for b, bk in enumerate(self.layout.buckets)
            if bk.kind == "reduce_scatter"
        ]
        for p in replicas:
            p.wait()

    def _send(self, b: int) -> None:
        bk = self.layout.buckets[b]
        region = self.flat[bk.start : bk.start + bk.size]
        if b != len(self.layout.buckets) - 1:
            self._zero_unwritten(b)
            if self.finite is not None:
                self.finite &= all_finite(region)
        if bk.kind == "all_reduce":
            self.pending.append(all_reduce_sum_async(region, self.groups.world))
        else:
            received = self.layout.received(self.flat, self.out, b)
            self.pending.append(reduce_scatter_sum_async(received, region, self.groups.shard))
        self.next = b + 1

    def _zero_unwritten(self, b: int) -> None:
        if self.layout.copies_first():
            for i in self.layout.buckets[b].params:
                if i not in self.written:
                    self.layout.zero_slot(self.flat, i)


__all__ = ["Groups", "Sender"]
