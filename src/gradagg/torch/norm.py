"""Global gradient norm and clipping, every replicated parameter counted exactly once.

Which rank counts a parameter is declared or read from its placements, never guessed:

* with an :class:`~gradagg.torch.ownership.Ownership`, each rank counts the
  shards it owns (a tensor-parallel duplicate is owned by one rank, a sharded
  parameter by the rank holding it); :meth:`Ownership.from_module` reads that
  table from DTensor placements;
* with ``ownership=None`` in a process group, a plain tensor is taken to be a
  data-parallel replica, identical on all ranks after the gradient reduction,
  and rank 0 of the group counts it; a DTensor's local piece is counted as
  :func:`~gradagg.torch.placements.counts_here` says (``Shard``: each rank its
  piece; ``Replicate``: coordinate 0; ``Partial``: refused).

Every rank ends with the very same number (one all_reduce), so they clip
identically even if their copies differ by round-off, and with the same dtype:
float64 if any rank passed a float64 (or complex128) gradient, else float32,
agreed in that all_reduce rather than read from local gradients. Per-tensor
norms of float16 and bfloat16 gradients are computed in float32 (torch rounds
them to the gradient's dtype, and float16 overflows above 65504).

The same tensor passed twice (tied weights) is counted once. The squared norms
travel as float64 in one all_reduce of 2 + W numbers (sum of squares, dtype
flag, one error flag per rank, so that an invalid parameter on one rank raises
on every rank instead of leaving the others waiting; reading the flags back is
one small device-to-host copy per call); with no process group
there is no communication and the result equals :func:`torch.nn.utils.clip_grad_norm_`
for float32 and float64 gradients, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from gradagg.errors import (
    CollectiveError,
    GradaggError,
    GradientShapeError,
    IdError,
    NonFiniteGradientError,
    PlacementError,
)
from gradagg.torch.collectives import Group, all_reduce_sum, device_for, get_rank, get_world_size, is_distributed
from gradagg.torch.ownership import Ownership
from gradagg.torch.placements import ShardId, ShardMap, counts_here, is_dtensor, local_tensor, shard_id

_Pairs = list[tuple[ShardId | None, torch.Tensor]]
Params = torch.Tensor | Iterable[torch.Tensor] | ShardMap[torch.Tensor] | Iterable[tuple[ShardId, torch.Tensor]]
_WIDE = (torch.float64, torch.complex128)  # a gradient of these makes the result float64


def grad_norm(
    params: Params,
    *,
    ownership: Ownership | None = None,
    group: Group = None,
    replica_group: Group = None,
    copies: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """The global 2-norm of the gradients of ``params``, each parameter counted once.

    Args:
        params: tensors (``model.parameters()``), or name -> tensor / ``(name, tensor)`` pairs
            (``model.named_parameters()``), which ``ownership`` requires. Tensors without ``.grad`` are skipped.
            Plain tensors and DTensors may mix, on different meshes.
        ownership: who counts each shard (a DTensor's shard id is :func:`~gradagg.torch.placements.shard_id`
            of its name); None: plain tensors are replicas counted by rank 0, DTensors by their placements.
        group: a process group, or None for the default one (no group: one process, no communication).
            It must contain every rank of every DTensor's mesh.
        replica_group: the group in which a plain tensor is a data-parallel replica, counted by its rank 0
            (None: ``group`` itself). Under pipeline parallelism each stage holds different tensors: pass the
            stage's data-parallel group here and the whole world as ``group``. Unused with ``ownership``.
        copies: tensors among ``params`` whose gradient is a copy of one counted on another rank (a weight tied
            across pipeline stages, held by both): not counted here (``clip_grad_norm_`` still scales them).

    Returns:
        A 0-d float32 or float64 tensor (see the module docstring), the same bits on every rank (NaN or
        Inf if any counted gradient is); in a process group, on :func:`~gradagg.torch.collectives.device_for`.

    Raises:
        IdError: ``ownership`` is given and a parameter's shard id is not declared or ids are missing.
        GradientShapeError: ``ownership`` is given and a gradient's local shape differs from its declaration.
        PlacementError: a DTensor gradient with a ``Partial`` or unsupported placement, or off its mesh.
        CollectiveError: on the other ranks in those three cases (naming the faulty ranks); the ownership
            declarations differ across ranks; the all_reduce failed.

    >>> w = torch.zeros(2, requires_grad=True)
    >>> w.grad = torch.tensor([3.0, 4.0])
    >>> grad_norm([w, w])  # tied: counted once
    tensor(5.)
    """
    return _global_norm(_pairs(params), ownership, group, _Rule(replica_group, copies))


class _Rule:
    """Which plain tensors this rank counts: rank 0 of ``replicas`` does, except for declared copies."""

    def __init__(self, replicas: Group = None, copies: Iterable[torch.Tensor] = ()) -> None:
        self.replicas = replicas
        self.copies = {id(t) for t in copies}


def _global_norm(pairs: _Pairs, ownership: Ownership | None, group: Group, rule: _Rule) -> torch.Tensor:
    if ownership is not None:
        ownership.verify(group)
    counted, error = _counted_grads(pairs, ownership, group, rule)
    wide = any(t.grad is not None and t.grad.dtype in _WIDE for t in _distinct(pairs))
    if not is_distributed(group):
        if error is not None:
            raise error
        return _local_norm(counted, torch.float64 if wide else torch.float32)
    return _distributed_norm(counted, wide, error, group)


def _distributed_norm(
    counted: list[torch.Tensor], wide: bool, error: GradaggError | None, group: Group
) -> torch.Tensor:
    """One all_reduce of [sum of squares, ranks with a wide gradient, error flag per rank]; raise on every rank."""
    rank, world, device = get_rank(group), get_world_size(group), device_for(group)
    flags = [1.0 if wide else 0.0] + [0.0] * world
    flags[1 + rank] = 0.0 if error is None else 1.0
    buf = torch.cat([_sum_of_squares(counted, device).reshape(1), torch.tensor(flags, dtype=torch.float64).to(device)])
    all_reduce_sum(buf, group)
    meta = buf[1:].tolist()  # one small read back: errors must raise on every rank, and the dtype is agreed
    bad = [r for r, v in enumerate(meta[1:]) if v != 0]
    if error is not None:
        raise error
    if bad:
        raise CollectiveError(
            f"rank {rank}: grad_norm got invalid parameters on rank(s) {bad} (their own error names the "
            "parameter); no norm was computed"
        )
    return buf[0].sqrt().to(torch.float64 if meta[0] != 0 else torch.float32)


def clip_grad_norm_(
    params: Params,
    max_norm: float,
    *,
    ownership: Ownership | None = None,
    group: Group = None,
    replica_group: Group = None,
    copies: Iterable[torch.Tensor] = (),
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale every gradient of ``params`` so that the global norm is at most ``max_norm``.

    The coefficient is ``max_norm / (norm + 1e-6)`` clamped to 1, exactly as
    :func:`torch.nn.utils.clip_grad_norm_`; every gradient passed is scaled,
    replicas included, so replicas stay identical (a DTensor's local piece is
    scaled in place). The norm is the same on every rank, so every rank takes the
    same decision and scales by the same coefficient (NaN included).

    Args:
        params: as for :func:`grad_norm`.
        max_norm: the largest norm allowed.
        ownership: as for :func:`grad_norm`.
        group: as for :func:`grad_norm`.
        replica_group: as for :func:`grad_norm`.
        copies: as for :func:`grad_norm`; their gradients are scaled too, so that tied copies stay equal.
        error_if_nonfinite: raise instead of scaling when the norm is NaN or Inf (on every rank).

    Returns:
        The global norm before clipping.

    Raises:
        NonFiniteGradientError: ``error_if_nonfinite`` and the norm is NaN or Inf; raised on every rank.
        IdError, GradientShapeError, PlacementError, CollectiveError: as for :func:`grad_norm`.

    >>> w = torch.zeros(2, requires_grad=True)
    >>> w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm_([w], 1.0), w.grad
    (tensor(5.), tensor([0.6000, 0.8000]))
    """
    pairs = _pairs(params)
    total = _global_norm(pairs, ownership, group, _Rule(replica_group, copies))
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise NonFiniteGradientError(
            f"rank {get_rank(group)}: the global gradient norm is {float(total)!r}; every rank sees the same value "
            "and raises; skip this step (zero the gradients) or pass error_if_nonfinite=False to scale anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale([local_tensor(t.grad) for t in _distinct(pairs) if t.grad is not None], coef)
    return total


# --- helpers -------------------------------------------------------------------


def _pairs(params: Params) -> _Pairs:
    """Normalise the accepted forms to (shard id or None, tensor) pairs."""
    if isinstance(params, torch.Tensor):
        return [(None, params)]
    if isinstance(params, Mapping):
        return list(params.items())
    out: list[tuple[ShardId | None, torch.Tensor]] = []
    for item in params:
        out.append((None, item) if isinstance(item, torch.Tensor) else (item[0], item[1]))
    return out


def _distinct(pairs: _Pairs) -> list[torch.Tensor]:
    # Tied weights are one tensor object reachable twice: count (and scale) it once.
    seen: set[int] = set()
    out = []
    for _, t in pairs:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _counted_grads(
    pairs: _Pairs, ownership: Ownership | None, group: Group, rule: _Rule
) -> tuple[list[torch.Tensor], GradaggError | None]:
    """The local gradients this rank counts, or the first invalid parameter's error (raised after the collective)."""
    rank = get_rank(group)
    seen: set[int] = set()
    counted = []
    for name, t in pairs:
        try:
            owned = _counts(name, t, ownership, group, rank, rule)
        except GradaggError as exc:
            return [], exc
        if id(t) in seen:
            continue  # tied: the first name under which the tensor appears decides
        seen.add(id(t))
        if owned and t.grad is not None and id(t) not in rule.copies:
            counted.append(local_tensor(t.grad))
    return counted, None


def _counts(
    name: ShardId | None, t: torch.Tensor, ownership: Ownership | None, group: Group, rank: int, rule: _Rule
) -> bool:
    """Whether this rank counts ``t``'s gradient (its local piece of it); raises for an invalid parameter."""
    try:
        if t.grad is not None and is_dtensor(t.grad) != is_dtensor(t):
            kinds = ["a DTensor" if is_dtensor(x) else "a plain tensor" for x in (t, t.grad)]
            raise PlacementError(f"the parameter is {kinds[0]} but its gradient is {kinds[1]}")
        if ownership is None:
            x = t.grad if t.grad is not None else t
            if rule.replicas is not None and not is_dtensor(x):
                return get_rank(rule.replicas) == 0
            return counts_here(x, group)
        return _declared_owner(name, t, ownership, rank) == rank
    except PlacementError as exc:
        label = repr(name) if name is not None else f"(unnamed, shape {tuple(t.shape)})"
        raise PlacementError(f"rank {rank}: parameter {label}: {exc}") from None


def _declared_owner(name: ShardId | None, t: torch.Tensor, ownership: Ownership, rank: int) -> int:
    """The declared owner of this rank's piece of ``t``, after checking the piece against its declaration."""
    if name is None:
        raise IdError("grad_norm with an ownership needs shard ids: pass named_parameters() or a mapping")
    sid = name if isinstance(name, int) else shard_id(name, t)
    grad = t.grad
    if grad is not None and isinstance(name, str) and shard_id(name, grad) != sid:
        raise PlacementError(f"its gradient is shard {shard_id(name, grad)!r} but the parameter is {sid!r}")
    if sid not in ownership:
        raise IdError(f"rank {rank}: parameter {sid!r} is not declared in the ownership")
    spec = ownership.spec(sid)
    if grad is not None and tuple(local_tensor(grad).shape) != spec.shape:
        shape = tuple(local_tensor(grad).shape)
        raise GradientShapeError(
            f"rank {rank}: gradient of {sid!r} has local shape {shape}; declared {spec.describe()}"
        )
    return spec.owner


def _tensor_norm(g: torch.Tensor) -> torch.Tensor:
    """One gradient's 2-norm as torch computes it, except that float16/bfloat16 are reduced into float32."""
    narrow = g.dtype in (torch.float16, torch.bfloat16)
    norm: torch.Tensor = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32 if narrow else None)
    return norm


def _local_norm(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The 2-norm of ``grads`` computed the way torch.nn.utils.clip_grad_norm_ does (per tensor, then stacked)."""
    if not grads:
        return torch.tensor(0.0, dtype=dtype)
    norms = [_tensor_norm(g) for g in grads]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(grads[0].device, dtype) for n in norms]), 2.0)
    return total


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum over ``grads`` of their squared norms, in float64 on ``device``: what the ranks add up."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([_tensor_norm(g).to(device, torch.float64) for g in grads])
    return (norms * norms).sum()


def _scale(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient in place by ``coef`` (a 0-d tensor), per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    # torch._foreach_mul_ is private (torch.nn.utils.clip_grad_norm_ uses it): one kernel per group instead of
    # one per tensor. The public per-tensor mul_ is the fallback, and the tests run it.
    foreach = getattr(torch, "_foreach_mul_", None)
    for (device, _), group in groups.items():
        c = coef.to(device)
        if foreach is not None:
            foreach(group, c)
        else:
            for g in group:
                g.mul_(c)
