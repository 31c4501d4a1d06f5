"""Thin named collectives over one private reducer, counted.

Every collective gradagg issues goes through one private function, :func:`_collective`
(torchtitan's ``_dist_reduce_tensor`` plays that part there); the named wrappers
(:func:`all_reduce_sum`, :func:`all_reduce_sum_async`, :func:`reduce_scatter_sum_async`,
:func:`all_gather_into`, :func:`all_gather_object`, :func:`broadcast_from_first`) only say what to call and what the
operation means on one rank, so that

* one code path serves one process and many: ``group=None`` means what it means
  in :mod:`torch.distributed` (the default group) when a process group is
  initialised, and with no process group at all (or a group of one rank) the
  call does what the operation means on one rank, without communication;
* a failed or timed-out collective becomes a :class:`~gradagg.errors.CollectiveError`
  naming the rank and the operation, instead of a bare backend ``RuntimeError``;
* tests and benchmarks can count what was sent: :func:`count_collectives`.

Only collectives that actually communicate are counted: with no process group
the count stays 0, which is how the tests show "no communication".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gradagg.errors import CollectiveError, GradaggError, first_line

Group = Any  # a torch.distributed ProcessGroup, or None for the default group


@dataclass
class CollectiveCount:
    """Collectives issued inside one :func:`count_collectives` block.

    Attributes:
        by_op: number of calls per operation name, e.g. ``{"all_reduce": 1}``.
        elements: number of tensor elements sent per operation name (objects: 0).
    """

    by_op: Counter[str] = field(default_factory=Counter)
    elements: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """All collectives counted, whatever the operation."""
        return sum(self.by_op.values())


_counters: list[CollectiveCount] = []
_counters_lock = threading.Lock()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCount]:
    """Count the collectives gradagg issues inside the block (nested blocks all count).

    Returns:
        A context manager yielding a :class:`CollectiveCount` that fills as collectives run.

    >>> with count_collectives() as c:
    ...     _ = all_reduce_sum(torch.ones(3))  # no process group: no communication
    >>> c.total
    0
    """
    counter = CollectiveCount()
    with _counters_lock:
        _counters.append(counter)
    try:
        yield counter
    finally:
        with _counters_lock:
            _counters.remove(counter)


def _record(op: str, elements: int) -> None:
    with _counters_lock:
        for counter in _counters:
            counter.by_op[op] += 1
            counter.elements[op] += elements


def is_distributed(group: Group = None) -> bool:
    """Whether collectives on ``group`` communicate: a process group is initialised, this rank belongs to
    ``group`` (None: the default group) and ``group`` has more than one rank.

    A group of one rank, like no group at all, runs as one process with no communication (a sum over one
    rank is the value itself); a rank outside ``group`` takes part in none of its collectives, as in
    :mod:`torch.distributed`.

    >>> is_distributed()  # a plain process
    False
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1  # -1 on a rank outside the group


def check_launcher_world(what: str) -> None:
    """Refuse a launcher's world without a process group: ``WORLD_SIZE`` > 1 in the environment, no group.

    A launcher (``torchrun``, ``accelerate launch``) started several processes, but nobody called
    ``init_process_group``: every collective would then run as one process, each rank accumulating its own
    gradients alone, silently. A ``WORLD_SIZE`` that is not an integer is no launcher's and is left alone.

    Args:
        what: what is being built, for the message (e.g. ``"MicrobatchAccumulator"``).

    Raises:
        GradaggError: naming ``WORLD_SIZE`` and the fix.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        raise GradaggError(
            f"{what}: WORLD_SIZE is {world} in the environment (a launcher started {world} processes) but "
            "torch.distributed has no process group, so each rank would accumulate alone, silently; call "
            "torch.distributed.init_process_group() before building it (under Accelerate on a CPU machine: "
            "Accelerator(cpu=True), which joins the launcher's world)"
        )


def check_member(group: Group, what: str) -> None:
    """Refuse a process group this process is not in (``new_group(ranks)`` returns a marker on the other ranks).

    Collectives on such a group take no part in it (see :func:`is_distributed`): an accumulator built on one would
    run alone, or fail inside torch with "Invalid process group specified".

    Args:
        group: the group given (None: the default group, which every rank is in).
        what: what is being built, for the message (e.g. ``"MicrobatchAccumulator"``).

    Raises:
        GradaggError: naming the group and this process's global rank.

    >>> check_member(None, "MicrobatchAccumulator")  # a plain process: no group to be outside of
    """
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_rank(group) < 0:  # torch's answer for a rank outside the group
        raise GradaggError(
            f"{what}: global rank {dist.get_rank()} is not in the process group it was given (group={group!r}, what "
            "torch.distributed.new_group returns on the ranks it leaves out): build it only on the group's ranks, "
            "with each rank's own group"
        )


def get_rank(group: Group = None) -> int:
    """This process's rank in ``group``; 0 with no process group (or a group of one).

    >>> get_rank()
    0
    """
    return dist.get_rank(group) if is_distributed(group) else 0


def get_world_size(group: Group = None) -> int:
    """Number of ranks in ``group``; 1 with no process group (or a group of one).

    >>> get_world_size()
    1
    """
    return dist.get_world_size(group) if is_distributed(group) else 1


def device_for(group: Group = None) -> torch.device:
    """The device a collective buffer must live on for ``group``'s backend.

    NCCL only moves CUDA tensors (on the current device, which the caller set
    with ``torch.cuda.set_device``); gloo and the no-group case use the CPU.

    >>> device_for()
    device(type='cpu')
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


T = TypeVar("T")


def _collective(op: str, what: str, elements: int, group: Group, issue: Callable[[], T], alone: Callable[[], T]) -> T:
    """The one place a collective is issued: ``alone()`` without communication, else ``issue()``, counted.

    Args:
        op: the operation's name, for counts and messages (e.g. ``"all_reduce(sum)"``).
        what: what it moves, for messages (e.g. ``"16 elements of torch.float64"``).
        elements: tensor elements sent (0 for objects), for :func:`count_collectives`.
        group: the process group.
        issue: calls :mod:`torch.distributed`.
        alone: what the operation means on one rank (the identity, or a copy).

    Raises:
        CollectiveError: the backend failed or timed out (DistBackendError and gloo's timeouts are RuntimeErrors).
    """
    if not is_distributed(group):
        return alone()
    _record(op, elements)
    try:
        return issue()
    except RuntimeError as exc:
        raise _failure(op, what, group, exc) from exc


def _failure(name: str, what: str, group: Group, exc: BaseException) -> CollectiveError:
    return CollectiveError(
        f"rank {get_rank(group)} of {get_world_size(group)}: {name} over {what} failed: {first_line(exc)} "
        "(a peer rank died, diverged or timed out; every rank must call the same collectives in the same order)"
    )


def _elements(t: torch.Tensor) -> str:
    return f"{t.numel()} elements of {t.dtype}"


def all_reduce_sum(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group``, in place, and return it.

    Args:
        tensor: on :func:`device_for` ``(group)``; same shape and dtype on every rank.
        group: a process group, or None for the default one.

    Returns:
        ``tensor``, now holding the sum over ranks (unchanged with no process group).

    Raises:
        CollectiveError: the collective failed or timed out (e.g. a peer died).

    >>> all_reduce_sum(torch.tensor([1.0, 2.0]))
    tensor([1., 2.])
    """
    all_reduce_sum_async(tensor, group).wait()
    return tensor


class Pending:
    """A collective in flight (``async_op=True``): :meth:`wait` completes it or raises :class:`CollectiveError`.

    With no process group the operation already happened and :meth:`wait` does nothing.

    >>> all_reduce_sum_async(torch.ones(2)).wait()
    """

    def __init__(self, work: Any, name: str, what: str, group: Group) -> None:
        self._work, self._name, self._what, self._group = work, name, what, group

    def wait(self) -> None:
        """Block until the collective completed (idempotent).

        Raises:
            CollectiveError: the collective failed or timed out (e.g. a peer died).
        """
        work, self._work = self._work, None
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as exc:
            raise _failure(self._name, self._what, self._group, exc) from exc


def all_reduce_sum_async(tensor: torch.Tensor, group: Group = None) -> Pending:
    """Start summing ``tensor`` over the ranks of ``group`` in place; the result is there after ``wait()``.

    Args:
        tensor: contiguous, on :func:`device_for` ``(group)``; same shape and dtype on every rank.
        group: a process group, or None for the default one.

    Returns:
        A :class:`Pending` handle; do not touch ``tensor`` before its ``wait()``.

    Raises:
        CollectiveError: the collective could not be started.

    >>> t = torch.ones(2)
    >>> all_reduce_sum_async(t).wait(); t
    tensor([1., 1.])
    """
    op, what = "all_reduce(sum)", _elements(tensor)  # all_reduce and reduce_scatter sum by default
    work = _collective(
        op, what, tensor.numel(), group, lambda: dist.all_reduce(tensor, group=group, async_op=True), lambda: None
    )
    return Pending(work, op, what, group)


def reduce_scatter_sum_async(output: torch.Tensor, tensor: torch.Tensor, group: Group = None) -> Pending:
    """Start a reduce-scatter: ``output`` on rank r becomes the sum over ranks of ``tensor[r * n:(r + 1) * n]``.

    Args:
        output: 1-d, ``n`` elements, same dtype and device as ``tensor``.
        tensor: 1-d, ``world_size * n`` elements; same size on every rank.
        group: a process group, or None for the default one.

    Returns:
        A :class:`Pending` handle (with no process group ``output`` already holds ``tensor``).

    Raises:
        CollectiveError: the collective could not be started.

    >>> out = torch.empty(2)
    >>> reduce_scatter_sum_async(out, torch.tensor([3.0, 4.0])).wait(); out
    tensor([3., 4.])
    """
    op, what = "reduce_scatter(sum)", _elements(tensor)
    # reduce_scatter_single is the newer name (torch >= 2.10); reduce_scatter_tensor is deprecated there.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def alone() -> None:
        output.copy_(tensor)

    work = _collective(
        op, what, tensor.numel(), group, lambda: scatter(output, tensor, group=group, async_op=True), alone
    )
    return Pending(work, op, what, group)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Gather one equally sized tensor from every rank into ``output``, rank r's at ``output[r * n:(r + 1) * n]``.

    Args:
        output: 1-d, ``world_size * tensor.numel()`` elements, same dtype and device as ``tensor``.
        tensor: this rank's part, 1-d; same size on every rank.
        group: a process group, or None for the default one.

    Returns:
        ``output``, filled (with no process group: a copy of ``tensor``).

    Raises:
        CollectiveError: the collective failed or timed out.

    >>> all_gather_into(torch.empty(2), torch.tensor([5.0, 6.0]))
    tensor([5., 6.])
    """
    # all_gather_single is the newer name (torch >= 2.10); all_gather_into_tensor is deprecated there.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _collective("all_gather", _elements(tensor), tensor.numel(), group, lambda: gather(output, tensor, group=group),
                lambda: output.copy_(tensor))
    return output


def broadcast_from_first(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank of ``group`` with the value it has on the group's rank 0, in place.

    Args:
        tensor: contiguous, on :func:`device_for` ``(group)``; same shape and dtype on every rank.
        group: a process group, or None for the default one.

    Returns:
        ``tensor`` (unchanged with no process group: rank 0 is this process).

    Raises:
        CollectiveError: the collective failed or timed out.

    >>> broadcast_from_first(torch.tensor([7.0]))
    tensor([7.])
    """

    def issue() -> None:
        # dist.broadcast takes a global rank as its source: the group's rank 0, translated
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(tensor, src=src, group=group)

    _collective("broadcast", _elements(tensor), tensor.numel(), group, issue, lambda: None)
    return tensor


def all_gather_object(obj: object, group: Group = None) -> list[object]:
    """Gather one picklable object from every rank of ``group`` (for small metadata only).

    Args:
        obj: any picklable object.
        group: a process group, or None for the default one.

    Returns:
        One object per rank, in rank order (``[obj]`` with no process group).

    Raises:
        CollectiveError: the collective failed or timed out.

    >>> all_gather_object({"w": 0})
    [{'w': 0}]
    """
    out: list[object] = [obj]

    def issue() -> None:
        out[:] = [None] * get_world_size(group)
        dist.all_gather_object(out, obj, group=group)

    _collective("all_gather_object", type(obj).__name__, 0, group, issue, lambda: None)
    return out


_MAX_NAMED = 5  # differences named in one mismatch message; the rest are counted


def check_same_on_all_ranks(entries: list[tuple[object, str]], what: str, group: Group = None) -> None:
    """Check that every rank of ``group`` holds the same ``(key, description)`` entries, before data moves.

    One ``all_gather_object`` of a digest; only when digests differ, a second one of the entries themselves,
    so that the message can name the values. Every rank sees the same gathered data, so every rank raises
    the same error. The model is PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` fingerprint check.

    Args:
        entries: e.g. ``[("w", "(shape=(4, 3), dtype=float32, owner=0)"), ...]``, in a canonical order.
        what: what the entries are, for the message (e.g. ``"ownership declarations"``).
        group: a process group, or None for the default one (no group: nothing to compare).

    Raises:
        CollectiveError: on every rank, naming rank 0, the differing rank, the key and both descriptions.

    >>> check_same_on_all_ranks([("w", "(shape=(2,))")], "parameters")
    """
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    if len(set(all_gather_object(digest, group))) > 1:
        tables = all_gather_object(entries, group)
        raise CollectiveError(_mismatch_message(tables, what))  # type: ignore[arg-type]


def _mismatch_message(tables: list[list[tuple[object, str]]], what: str) -> str:
    """Name the first differences between rank 0's entries and every other rank's."""
    base = dict(tables[0])
    diffs: list[str] = []
    for r, table in enumerate(tables[1:], start=1):
        other = dict(table)
        for key in list(base) + [k for k in other if k not in base]:
            a, b = base.get(key), other.get(key)
            if a != b:
                diffs.append(f"rank 0 declared {key!r} as {a or 'nothing'}, but rank {r} declared {b or 'nothing'}")
    named = "; ".join(diffs[:_MAX_NAMED])
    more = f" (and {len(diffs) - _MAX_NAMED} more differences)" if len(diffs) > _MAX_NAMED else ""
    return (
        f"{what} differ across the {len(tables)} ranks of the group, detected before any gradient moved: {named}{more}"
    )
