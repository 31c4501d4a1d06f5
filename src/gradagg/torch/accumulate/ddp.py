"""DistributedDataParallel under the accumulator: DDP's own reduction held off with its public ``no_sync()``.

DDP reduces only when every rank runs a synchronised backward, and divides by the world size. With
uneven microbatch counts (a rank with none at all, in particular) its bucket all-reduces, its one-time
bucket rebuild and its buffer broadcasts would not match across ranks. So while an accumulator is
attached, DDP stays inside ``no_sync()`` (entered once, left by :meth:`DdpHold.release`) and sends nothing;
the accumulator reduces the gradients in its own buckets, which keep DDP's overlap with backward when the
last microbatch is marked (see :meth:`~gradagg.torch.MicrobatchAccumulator.microbatches`).

Buffers: DDP built with its default (``broadcast_buffers`` / ``forward_sync_buffers`` True, what Accelerate
and Lightning build) broadcasts the module's buffers from rank 0 before a synchronised forward, so under its
own ``no_sync()`` accumulation every window starts with rank 0's buffers. A forward-time broadcast cannot match
across ranks that run different numbers of forwards, so while held DDP's forward sync is turned off and the
accumulator keeps that meaning itself: :meth:`DdpHold.sync_buffers` broadcasts the buffers DDP would sync (the
module's named buffers minus ``parameters_to_ignore``) from the group's rank 0 when the accumulator is built
and in every ``finish()``, after the gradients were exchanged: points every rank reaches whatever its
microbatch count, none included. Within a window each rank's buffers evolve with its own forwards, as under
DDP. ``discard()`` broadcasts nothing (it is local); the next ``finish()`` does. DDP's setting is restored by
:meth:`DdpHold.release` (``close()``).

Only public API: ``DistributedDataParallel.no_sync``, its ``forward_sync_buffers`` attribute (torch >= 2.13,
read by its ``_pre_forward``; ``broadcast_buffers`` is a property over it there, the attribute itself before)
and ``parameters_to_ignore``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gradagg.errors import GradaggError
from gradagg.torch.collectives import Group, broadcast_from_first, device_for


class DdpHold:
    """Keep a DDP module in ``no_sync()``, its forward buffer sync off, from construction until :meth:`release`.

    Args:
        ddp: the wrapped module.
        group: the accumulator's process group, over which the buffers are broadcast.

    Raises:
        GradaggError: ``static_graph=True``: DDP's static graph records which parameters the first
            iterations reduce and asserts that later ones match, which ``no_sync()`` breaks (a PyTorch
            INTERNAL ASSERT in the backward); gradagg reduces the gradients itself, so DDP's static graph
            buys nothing here: construct DDP without it.
    """

    def __init__(self, ddp: DistributedDataParallel, group: Group = None) -> None:
        if getattr(ddp, "static_graph", False):  # a public attribute, set by DDP(static_graph=True)
            raise GradaggError(
                "DistributedDataParallel(static_graph=True) cannot run under no_sync(), where gradagg keeps it "
                "(PyTorch fails an internal assert in the backward); construct it without static_graph: gradagg "
                "reduces the gradients itself, so DDP's static-graph optimisations have nothing to do"
            )
        self.ddp, self.group = ddp, group
        self._option = _sync_option(ddp)
        self.syncs_buffers = bool(getattr(ddp, self._option, True))
        setattr(ddp, self._option, False)  # DDP's forward broadcasts nothing while held; sync_buffers() does
        self._held: contextlib.AbstractContextManager[Any] | None = ddp.no_sync()
        self._held.__enter__()
        try:
            self.sync_buffers()
        except BaseException:
            self.release()  # a failed broadcast leaves DDP as it was
            raise

    def sync_buffers(self) -> None:
        """Broadcast the buffers DDP would sync from the group's rank 0 (nothing if DDP was built not to).

        Call on every rank at the same point: one broadcast per buffer dtype.

        Raises:
            CollectiveError: the broadcast failed or timed out.
        """
        if not self.syncs_buffers or self._held is None:
            return
        ignored: set[str] = set(getattr(self.ddp, "parameters_to_ignore", ()))
        # re-read every time, as DDP does: a module may reassign its buffers
        buffers = [b for n, b in self.ddp.module.named_buffers() if n not in ignored]
        kinds: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in buffers:
            kinds.setdefault(b.dtype, []).append(b)
        device = device_for(self.group)
        with torch.no_grad():
            for same in kinds.values():  # in first-seen order: the same on every rank (the same module)
                flat = torch.cat([b.detach().reshape(-1).to(device) for b in same])
                broadcast_from_first(flat, self.group)
                start = 0
                for b in same:
                    b.copy_(flat[start : start + b.numel()].view_as(b))
                    start += b.numel()

    def release(self) -> None:
        """Leave ``no_sync()`` and give DDP its buffer setting back: it synchronises its next forward and
        backward again (idempotent)."""
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)
            setattr(self.ddp, self._option, self.syncs_buffers)


def _sync_option(ddp: DistributedDataParallel) -> str:
    """The attribute DDP's forward reads: torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers``."""
    return "forward_sync_buffers" if hasattr(ddp, "forward_sync_buffers") else "broadcast_buffers"


__all__ = ["DdpHold"]
