"""DistributedDataParallel under the accumulator: DDP's own reduction held off with its public ``no_sync()``.

DDP reduces only when every rank runs a synchronised backward, and divides by the world size. With
uneven microbatch counts (a rank with none at all, in particular) its bucket all-reduces, its one-time
bucket rebuild and its buffer broadcasts would not match across ranks. So while an accumulator is
attached, DDP stays inside ``no_sync()`` (entered once, left by :meth:`DdpHold.release`) and sends nothing;
the accumulator reduces the gradients in its own buckets, which keep DDP's overlap with backward when the
last microbatch is marked (see :meth:`~gradagg.torch.MicrobatchAccumulator.microbatches`).

Only public API: ``DistributedDataParallel.no_sync`` and the ``forward_sync_buffers`` (torch >= 2.13) or
``broadcast_buffers`` constructor options.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from gradagg.errors import GradaggError


class DdpHold:
    """Keep a DDP module in ``no_sync()`` from construction until :meth:`release`.

    Args:
        ddp: the wrapped module.

    Raises:
        GradaggError: ``static_graph=True``: DDP's static graph records which parameters the first
            iterations reduce and asserts that later ones match, which ``no_sync()`` breaks (a PyTorch
            INTERNAL ASSERT in the backward); gradagg reduces the gradients itself, so DDP's static graph
            buys nothing here: construct DDP without it. The module has buffers and DDP would broadcast them
            at a forward. Under ``no_sync``
            DDP still broadcasts buffers at the first forward after construction; with uneven counts (a
            rank running no microbatch) that broadcast would meet a different collective on the other
            ranks. gradagg does not synchronise buffers: construct DDP with ``broadcast_buffers=False``
            (or ``forward_sync_buffers=False``) and keep the buffers the same by construction.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        if getattr(ddp, "static_graph", False):  # a public attribute, set by DDP(static_graph=True)
            raise GradaggError(
                "DistributedDataParallel(static_graph=True) cannot run under no_sync(), where gradagg keeps it "
                "(PyTorch fails an internal assert in the backward); construct it without static_graph: gradagg "
                "reduces the gradients itself, so DDP's static-graph optimisations have nothing to do"
            )
        if _syncs_buffers(ddp) and any(True for _ in ddp.module.buffers()):
            names = [n for n, _ in ddp.module.named_buffers()][:3]
            raise GradaggError(
                f"DistributedDataParallel would broadcast the buffers {names} at a forward, which cannot match "
                "across ranks running different numbers of microbatches; construct it with broadcast_buffers=False"
            )
        self.ddp = ddp
        self._held: contextlib.AbstractContextManager[Any] | None = ddp.no_sync()
        self._held.__enter__()

    def on_window_open(self) -> None:
        """Called on every rank as a window opens, after the layout check and before any bucket leaves."""

    def release(self) -> None:
        """Leave ``no_sync()``: DDP synchronises its next backward again (idempotent)."""
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)


def _syncs_buffers(ddp: DistributedDataParallel) -> bool:
    # torch 2.13 renamed the option (forward_sync_buffers); older releases store broadcast_buffers
    value = getattr(ddp, "forward_sync_buffers", None)
    if value is None:
        value = getattr(ddp, "broadcast_buffers", True)
    return bool(value)


__all__ = ["DdpHold"]
