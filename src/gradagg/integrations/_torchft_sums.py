"""What travels in torchft's all-reduce for :mod:`gradagg.integrations.torchft`, and what comes back out of it.

Two kinds of tensor, each summed over the replica groups (``ReduceOp.SUM``; torchft zeroes both for a group that
does not take part in the step):

* the gradient SUM, one flat buffer per (dtype, device): each group's finished gradient times its own divisor
  ``D_g``, zeros where the group gave a parameter no gradient (absent adds nothing: the token mean counts it as 0);
* the COUNTS, float64 (a float32 count is no longer exact beyond 2**24 tokens): per quorum slot the group's weight,
  microbatches, window token (a random integer below 2**52 naming this window of this group: after the sum every
  group knows which windows a step holds) and size (its ranks: torchft pairs rank r of each group, so the groups must
  have as many), one flag per weighting, and each parameter's participation. The slot (torchft's
  ``participating_rank()``) keeps each contributing group's counts apart through the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from gradagg.errors import WindowError

NONE, WEIGHTED, UNWEIGHTED, OTHER = -1, 0, 1, 2
"""How a group counted its window: NONE (ran nothing: no flag), with weights, without, or another way
(``divisors()``, refused). The last three are the flags that travel, summed over the groups."""
_FLAGS = 3
_NAMES = ("with weights", "without weights", "divided ahead (divisors())")

Key = tuple[torch.dtype, torch.device]


TOKEN_BITS = 52
"""A window token is below 2**52: exact in float64, and a sum with zeros in the other groups' places."""


_PER_SLOT = 4  # weight, microbatches, token, size


def counts(m: int, weight: float, mode: int, participation: list[float], slots: int,
           slot: int | None, token: int = 0, size: int = 1) -> torch.Tensor:
    """The group's counts laid out for the sum:
    ``[weight per slot, microbatches per slot, token per slot, size per slot, flags, participation]``.

    Args:
        m: the group's microbatches; weight: their total weight (0 without weights).
        mode: WEIGHTED, UNWEIGHTED, OTHER or NONE.
        participation: per parameter, the microbatches in which it got a gradient (over the group).
        slots: ``manager.num_participants()``; slot: ``manager.participating_rank()`` (None: not taking part).
        token: the window's token (see the module's docstring).
        size: the group's ranks.

    Returns:
        A float64 tensor, all zeros when ``slot`` is None.

    >>> counts(2, 7.0, WEIGHTED, [2.0], slots=2, slot=1, token=5, size=2).tolist()
    [0.0, 7.0, 0.0, 2.0, 0.0, 5.0, 0.0, 2.0, 1.0, 0.0, 0.0, 2.0]
    """
    out = torch.zeros(_PER_SLOT * slots + _FLAGS + len(participation), dtype=torch.float64)
    if slot is None:
        return out
    out[slot], out[slots + slot], out[2 * slots + slot], out[3 * slots + slot] = weight, m, token, size
    if mode != NONE:
        out[_PER_SLOT * slots + mode] = 1
    out[_PER_SLOT * slots + _FLAGS:] = torch.tensor(participation, dtype=torch.float64)
    return out


@dataclass(frozen=True)
class Totals:
    """The summed counts, read back (the same on every group).

    >>> summed = torch.tensor([3.0, 4.0, 1.0, 2.0, 8.0, 9.0, 2.0, 1.0, 2.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    >>> t = Totals.of(summed, slots=2)
    >>> t.divisor, t.microbatches, t.per_slot(), t.participation, t.tokens, t.sizes
    (7.0, 3, (3.0, 4.0), [1.0], frozenset({8, 9}), (2, 1))
    """

    weights: tuple[float, ...]
    per_group_m: tuple[int, ...]
    flags: tuple[int, ...]
    participation: list[float]
    tokens: frozenset[int] = frozenset()
    sizes: tuple[int, ...] = ()  # the ranks of each group that contributed (a slot left zero contributed nothing)

    @classmethod
    def of(cls, summed: torch.Tensor, slots: int) -> Totals:
        """Read ``summed`` (laid out by :func:`counts`) for ``slots`` quorum slots."""
        v = summed.tolist()
        tokens = frozenset(int(x) for x in v[2 * slots:3 * slots] if x)
        sizes = tuple(int(x) for x in v[3 * slots:4 * slots] if x)
        end = _PER_SLOT * slots
        return cls(tuple(v[:slots]), tuple(int(x) for x in v[slots:2 * slots]),
                   tuple(int(x) for x in v[end:end + _FLAGS]), v[end + _FLAGS:], tokens, sizes)

    @property
    def mode(self) -> int:
        return WEIGHTED if self.flags[WEIGHTED] else UNWEIGHTED

    @property
    def microbatches(self) -> int:
        return sum(self.per_group_m)

    @property
    def weight(self) -> float:
        return sum(self.weights)

    @property
    def divisor(self) -> float:
        """The total weight with weights, the total microbatches without."""
        return self.weight if self.mode == WEIGHTED else float(self.microbatches)

    def per_slot(self) -> tuple[float, ...]:
        """What each contributing slot counted: its weight with weights, its microbatches without."""
        return self.weights if self.mode == WEIGHTED else tuple(float(m) for m in self.per_group_m)

    def problem(self, group: str) -> WindowError | None:
        """Groups that counted differently: no divisor is right for all of them (the same answer on every group)."""
        used = [f"{n} groups {_NAMES[i]}" for i, n in enumerate(self.flags) if n]
        if self.flags[OTHER] or (self.flags[WEIGHTED] and self.flags[UNWEIGHTED]):
            return WindowError(f"group {group}: the replica groups counted their windows differently "
                               f"({', '.join(used)}); weight every microbatch on every group, or none, and do not "
                               "use divisors() across replica groups")
        return None


@dataclass
class Flats:
    """The gradient SUM, one flat buffer per (dtype, device), and where each parameter lies in it."""

    buffers: dict[Key, torch.Tensor]
    where: list[tuple[Key, int, int]]


def flatten(tensors: list[torch.Tensor], divisor: float, reuse: Flats | None = None, *, zeros: bool = False) -> Flats:
    """Each parameter's gradient times ``divisor`` (its group's SUM again), zeros where it has none, concatenated.

    Args:
        tensors: the accumulator's parameters.
        divisor: the group's ``D_g``, what its ``finish()`` divided by.
        reuse: the last window's buffers, written over when they fit (a fresh large buffer costs a page fault per
            page on its first write, every window; the gradients handed out from them were dropped before this
            window opened, as the accumulator requires; a retry writes over the buffers of its failed attempt).
        zeros: send nothing (a stale window): every element zero.

    Returns:
        The :class:`Flats`, new tensors (the gradients are not changed).

    >>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([0.5, 1.0])
    >>> flatten([w, torch.zeros(1, requires_grad=True)], 4.0).buffers
    {(torch.float32, device(type='cpu')): tensor([2., 4., 0.])}
    """
    sizes: dict[Key, int] = {}
    where: list[tuple[Key, int, int]] = []
    for t in tensors:
        key, n = (t.dtype, t.device), local(t.detach()).numel()
        where.append((key, sizes.get(key, 0), n))
        sizes[key] = sizes.get(key, 0) + n
    fits = reuse is not None and reuse.where == where
    buffers = reuse.buffers if reuse is not None and fits else {
        k: torch.empty(n, dtype=k[0], device=k[1]) for k, n in sizes.items()}
    for t, (key, start, n) in zip(tensors, where):
        out = buffers[key][start:start + n]
        if t.grad is None or zeros:
            out.zero_()
        else:  # one pass: the product written straight into the buffer
            torch.mul(local(t.grad).reshape(-1), divisor, out=out)
    return Flats(buffers, where)


def install(tensors: list[torch.Tensor], flats: Flats, divisor: float, participation: list[float]) -> None:
    """Divide the summed buffers once by ``divisor``; hand each parameter its view (None where no group had one).

    Args:
        tensors: the accumulator's parameters, in the order of :func:`flatten`.
        flats: the buffers after the all-reduce.
        divisor: the step's divisor (the total weight, or microbatches).
        participation: per parameter, in how many microbatches of all groups it got a gradient.
    """
    for buf in flats.buffers.values():
        buf.div_(divisor)
    for t, (key, start, n), p in zip(tensors, flats.where, participation):
        view = flats.buffers[key][start:start + n]
        if p == 0:
            t.grad = None
        elif t is not local(t):  # a DTensor (FSDP2): the buffer holds its local shard
            t.grad = _sharded_grad(t, view)
        else:
            t.grad = view.view_as(t)


def _sharded_grad(t: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The DTensor gradient of the DTensor parameter ``t`` whose local shard is ``view``: written into the gradient
    the group's own window left, or, where this group gave the parameter none and another group did, a new DTensor
    over the view, laid out as ``t`` (its mesh, placements, global shape and stride)."""
    shard = view.view_as(local(t.detach()))
    if t.grad is not None:
        local(t.grad).copy_(shard)
        return t.grad
    from torch.distributed.tensor import DTensor

    dt = cast(DTensor, t)  # it has a local shard: a DTensor
    return DTensor.from_local(shard, dt.device_mesh, dt.placements, shape=dt.shape, stride=dt.stride())


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its public ``to_local()``), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()  # type: ignore[no-any-return]


__all__ = ["NONE", "OTHER", "TOKEN_BITS", "UNWEIGHTED", "WEIGHTED", "Flats", "Totals", "counts", "flatten", "install",
           "local"]
