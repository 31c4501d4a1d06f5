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

Before each broadcast the ranks check, with one small all-gather of a digest, that the buffers agree in name,
dtype and shape (a buffer reassigned on one rank during the window would otherwise be broadcast into garbage, or
not at all): a mismatch raises :class:`~gradagg.errors.CollectiveError` on every rank, naming the buffer, the ranks
and both descriptions, before any buffer moves. A module without buffers when the accumulator is built sends
neither check nor broadcast in its windows (DDP too decides from the buffers it saw last).

DDP's own settings are kept:

* **its group**: the accumulator reduces over the group DDP reduces over (its ``process_group``, the default
  group when DDP was built without one): :func:`ddp_group` takes it when the accumulator is given none, and
  refuses a different one (averaging over other ranks than DDP would is not what the DDP model means).
* **its** ``parameters_to_ignore``: DDP never reduces them, each rank keeps its own gradient. The accumulator does
  not take them either (see :class:`~.params.Params`); their gradients sum over this rank's microbatches as
  autograd leaves them, and ``finish()`` divides them by *this rank's own* count (its microbatches, its total
  weight, or 1 for loss terms divided ahead): the rank-local mean that a DDP step with a per-rank mean loss
  gives them. Where this rank counted nothing (no microbatch, or a total weight of 0) their gradient is None;
  where their dtype cannot be divided by its count, every rank refuses the window, naming this one
  (:meth:`DdpHold.check_local`). The ledger names them (``Ledger.rank_local``).

Only public API: ``DistributedDataParallel.no_sync``, its ``forward_sync_buffers`` attribute (torch >= 2.13,
read by its ``_pre_forward``; ``broadcast_buffers`` is a property over it there, the attribute itself before),
``parameters_to_ignore`` and ``process_group`` (set by its constructor from its arguments).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradagg.errors import CollectiveError, GradaggError
from gradagg.torch.accumulate.counting import divisor_problem
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.window import PEER, WEIGHT, Window
from gradagg.torch.accumulate.wrappers.plain import Plain
from gradagg.torch.collectives import (
    Group,
    all_gather_into,
    all_gather_object,
    broadcast_from_first,
    device_for,
    get_rank,
    get_world_size,
)


class Ddp(Plain):
    """The :class:`~gradagg.torch.accumulate.seam.Wrapper` of a DDP module: held in ``no_sync()`` (:class:`DdpHold`),
    its buffers broadcast after each exchange, its ``parameters_to_ignore`` divided by this rank's own count."""

    name = "ddp"

    def __init__(self, hold: DdpHold) -> None:
        super().__init__()
        self.hold = hold

    def prepare(self, state: State, ran: bool) -> None:
        # before the exchange, so that every rank refuses a rank-local divisor this rank cannot divide by
        if self.hold.local:
            self.hold.check_local(state.window)

    def after_exchange(self, state: State) -> None:
        # every rank exchanged, whatever its count: the next window starts with rank 0's buffers
        self.hold.sync_buffers(state.window)

    def close(self, state: State) -> None:
        if self.hold.local:  # DDP's parameters_to_ignore: this rank's sum over its own count
            self.hold.divide_local(state.window.local_divisor())

    def discard(self, state: State) -> None:
        self.hold.drop_local()

    def release(self) -> None:
        self.hold.release()

    def refuses_terms(self) -> str | None:
        if not self.hold.local:
            return None
        return (f"terms= with DDP's parameters_to_ignore ({[n for n, _ in self.hold.local]}): their gradients are "
                "not taken by the accumulator, so no term could be told apart in them")


class DdpHold:
    """Keep a DDP module in ``no_sync()``, its forward buffer sync off, from construction until :meth:`release`.

    Args:
        ddp: the wrapped module.
        group: the accumulator's process group (DDP's, see :func:`ddp_group`), over which the buffers are broadcast.
        local: the trainable parameters DDP ignores (``parameters_to_ignore``), kept rank-local.

    Raises:
        GradaggError: ``static_graph=True``: DDP's static graph records which parameters the first
            iterations reduce and asserts that later ones match, which ``no_sync()`` breaks (a PyTorch
            INTERNAL ASSERT in the backward); gradagg reduces the gradients itself, so DDP's static graph
            buys nothing here: construct DDP without it.
        CollectiveError: the ranks' buffers differ in name, dtype or shape (every rank).
    """

    def __init__(self, ddp: DistributedDataParallel, group: Group = None,
                 local: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
        if getattr(ddp, "static_graph", False):  # a public attribute, set by DDP(static_graph=True)
            raise GradaggError(
                "DistributedDataParallel(static_graph=True) cannot run under no_sync(), where gradagg keeps it "
                "(PyTorch fails an internal assert in the backward); construct it without static_graph: gradagg "
                "reduces the gradients itself, so DDP's static-graph optimisations have nothing to do"
            )
        self.ddp, self.group, self.local = ddp, group, list(local)
        self._option = _sync_option(ddp)
        self.syncs_buffers = bool(getattr(ddp, self._option, True))  # DDP's own setting, given back by release()
        self._any = True  # whether the module held buffers to sync when built: as DDP, none then means none ever
        setattr(ddp, self._option, False)  # DDP's forward broadcasts nothing while held; sync_buffers() does
        self._held: contextlib.AbstractContextManager[Any] | None = ddp.no_sync()
        self._held.__enter__()
        try:
            self.sync_buffers()
        except BaseException:
            self.release()  # a failed broadcast leaves DDP as it was
            raise

    def sync_buffers(self, window: Window | None = None) -> None:
        """Broadcast the buffers DDP would sync from the group's rank 0 (nothing if DDP was built not to).

        Call on every rank at the same point: one small all-gather (the buffers' digest), then one broadcast per
        buffer dtype.

        Args:
            window: the window being finished, marked refused when the buffers differ (``discard()`` then).

        Raises:
            CollectiveError: the ranks' buffers differ in name, dtype or shape (every rank, naming the buffer, the
                ranks and both descriptions, before any buffer moved); the broadcast failed or timed out.
        """
        if not self.syncs_buffers or not self._any or self._held is None:
            return
        ignored: set[str] = set(getattr(self.ddp, "parameters_to_ignore", ()))
        # re-read every time, as DDP does: a module may reassign its buffers
        named = [(n, b) for n, b in self.ddp.module.named_buffers() if n not in ignored]
        problem = _buffers_differ(named, self.group)
        if problem is not None:
            if window is None:
                raise CollectiveError(problem)
            window.fail(PEER, problem)
            window.open = True  # stays refused on every rank until discard()
            raise CollectiveError(f"{problem}; the window's gradients were not handed out: call discard() on every "
                                  "rank")
        if window is None:  # built: the ranks agree on the buffers; without any, no window checks or sends any
            self._any = bool(named)
        _broadcast([b for _, b in named], self.group)

    def divide_local(self, divisor: float | None) -> None:
        """The rank-local parameters' gradients: this rank's sum divided by its own count (None: it counted none).

        Args:
            divisor: this rank's D (:meth:`~.window.Window.local_divisor`), or None where it counted nothing.
        """
        with torch.no_grad():
            for _, t in self.local:
                if t.grad is None or divisor == 1:
                    continue
                if divisor is None:
                    t.grad = None
                else:
                    t.grad.div_(divisor)

    def check_local(self, window: Window) -> None:
        """Fail the window (every rank then refuses) where the rank-local gradients cannot be divided by this rank's
        own count in their dtype (:func:`~gradagg.torch.accumulate.counting.divisor_problem`)."""
        divisor = window.local_divisor()
        if divisor is None or divisor == 1:
            return
        for name, t in self.local:
            problem = None if t.grad is None else divisor_problem(divisor, t.grad.dtype)
            if problem is not None:
                window.fail(WEIGHT, f"this rank's own count, {divisor!r}, which divides DDP's parameters_to_ignore "
                                    f"({name!r}), {problem}")
                return

    def drop_local(self) -> None:
        """Forget the rank-local parameters' gradients of a dropped window (``discard()``)."""
        for _, t in self.local:
            t.grad = None

    def release(self) -> None:
        """Leave ``no_sync()`` and give DDP its buffer setting back: it synchronises its next forward and
        backward again (idempotent)."""
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)
            setattr(self.ddp, self._option, self.syncs_buffers)


def ddp_group(ddp: DistributedDataParallel, group: Group) -> Group:
    """The group the accumulator reduces over: DDP's own (None where that is the default group).

    Args:
        ddp: the wrapped module.
        group: the group the accumulator was given (None: none given).

    Returns:
        ``group`` when it holds DDP's ranks; DDP's group when none was given.

    Raises:
        GradaggError: ``group`` holds other ranks than DDP's group, naming both.
    """
    own = getattr(ddp, "process_group", None)  # DDP sets it from process_group= or device_mesh=, else the default
    default = dist.group.WORLD
    own = None if own is None or own is default or _ranks(own) == _ranks(default) else own
    if group is None or _ranks(group) == _ranks(own if own is not None else default):
        return own if group is None else group
    raise GradaggError(
        f"MicrobatchAccumulator(group=...) holds global ranks {_ranks(group)}, but the DistributedDataParallel module "
        f"reduces over its process_group, global ranks {_ranks(own if own is not None else default)}: the "
        "accumulator must average over the ranks DDP averages over; leave group=None to take DDP's group, or build "
        "DDP with the group you mean"
    )


def _broadcast(buffers: list[torch.Tensor], group: Group) -> None:
    """Overwrite ``buffers`` with the group's rank 0's, one broadcast per dtype (the same order on every rank)."""
    kinds: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        kinds.setdefault(b.dtype, []).append(b)
    device = device_for(group)
    with torch.no_grad():
        for same in kinds.values():  # in first-seen order: the same on every rank (checked before)
            flat = torch.cat([b.detach().reshape(-1).to(device) for b in same])
            broadcast_from_first(flat, group)
            start = 0
            for b in same:
                b.copy_(flat[start : start + b.numel()].view_as(b))
                start += b.numel()


def _ranks(group: Group) -> list[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _describe(b: torch.Tensor) -> str:
    return f"{str(b.dtype).removeprefix('torch.')} of shape {tuple(b.shape)}"


def _buffers_differ(named: list[tuple[str, torch.Tensor]], group: Group) -> str | None:
    """Why the ranks' buffers cannot be broadcast (the same text on every rank), or None when they agree.

    One all-gather of a 62-bit digest of the ``(name, dtype, shape)`` list; only when the digests differ, one
    ``all_gather_object`` of the lists themselves, so that the message can name the differences.
    """
    world = get_world_size(group)
    if world == 1:
        return None
    entries = [(n, _describe(b)) for n, b in named]
    digest = int(hashlib.sha256(repr(entries).encode()).hexdigest()[:15], 16)  # < 2**60: an exact int64
    device = device_for(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    digests = all_gather_into(torch.empty(world, dtype=torch.int64, device=device), mine, group).tolist()
    if len(set(digests)) == 1:
        return None
    tables: list[Any] = all_gather_object(entries, group)
    return _difference(tables, get_rank(group))


def _difference(tables: list[list[tuple[str, str]]], rank: int) -> str:
    first = dict(tables[0])
    diffs = []
    for r, table in enumerate(tables[1:], start=1):
        other = dict(table)
        for name in [*first, *(n for n in other if n not in first)]:
            a, b = first.get(name, "absent"), other.get(name, "absent")
            if a != b:
                diffs.append(f"buffer {name!r} is {a} on rank 0 but {b} on rank {r}")
    shown = "; ".join(diffs[:5]) + (f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else "")
    return (
        f"rank {rank}: the buffers DDP broadcasts from rank 0 differ across the {len(tables)} ranks, so none was "
        f"broadcast: {shown}; every rank must hold the same buffers (a buffer reassigned on one rank only?)"
    )


def skip_buffer_sync(module: object) -> None:
    """Turn a DDP module's forward buffer sync off (the accumulator then broadcasts none either); other modules
    are left alone. For buffers the same on every rank by construction. Through DDP's public attribute, where
    DDP's ``broadcast_buffers`` constructor argument is deprecated (torch >= 2.13) and warns.

    Args:
        module: the model as a framework prepared it (a ``DistributedDataParallel`` or not).
    """
    if isinstance(module, DistributedDataParallel):
        setattr(module, _sync_option(module), False)


def _sync_option(ddp: DistributedDataParallel) -> str:
    """The attribute DDP's forward reads: torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers``."""
    return "forward_sync_buffers" if hasattr(ddp, "forward_sync_buffers") else "broadcast_buffers"


__all__ = ["Ddp", "DdpHold", "ddp_group", "skip_buffer_sync"]
