"""Global gradient norm and clipping, every replicated parameter counted exactly once.

Which rank counts a parameter is declared, never guessed:

* with an :class:`~gradagg.torch.ownership.Ownership`, each rank counts the
  shards it owns (a tensor-parallel duplicate is owned by one rank, a sharded
  parameter by the rank holding it);
* with ``ownership=None`` in a process group, every parameter is taken to be a
  data-parallel replica, identical on all ranks after the gradient reduction,
  and rank 0 of the group counts it. All ranks then divide by the very same
  number, so they clip identically even if their copies differ by round-off.

The same tensor passed twice (tied weights) is counted once. The squared norms
travel in one scalar ``all_reduce``; with no process group there is no
communication and the result equals :func:`torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from gradagg.errors import IdError, NonFiniteGradientError
from gradagg.torch.collectives import Group, all_reduce_sum, device_for, get_rank, is_distributed
from gradagg.torch.ownership import Ownership, ShardId

_Pairs = list[tuple[ShardId | None, torch.Tensor]]
Params = torch.Tensor | Iterable[torch.Tensor] | Mapping[ShardId, torch.Tensor] | Iterable[tuple[ShardId, torch.Tensor]]


def grad_norm(params: Params, *, ownership: Ownership | None = None, group: Group = None) -> torch.Tensor:
    """The global 2-norm of the gradients of ``params``, each parameter counted once.

    Args:
        params: tensors (``model.parameters()``), or shard id -> tensor / ``(shard id, tensor)`` pairs
            (``model.named_parameters()``), which ``ownership`` requires. Tensors without ``.grad`` are skipped.
        ownership: who counts each shard; None means "replicated on every rank, rank 0 counts".
        group: a process group, or None for the default one (no group: one process, no communication).

    Returns:
        A 0-d float tensor, the same on every rank (NaN or Inf if any counted gradient is).

    Raises:
        IdError: ``ownership`` is given and a parameter's shard id is not declared or ids are missing.
        CollectiveError: the ownership declarations differ across ranks, or the all_reduce failed.

    >>> w = torch.zeros(2, requires_grad=True)
    >>> w.grad = torch.tensor([3.0, 4.0])
    >>> grad_norm([w, w])  # tied: counted once
    tensor(5.)
    """
    return _global_norm(_pairs(params), ownership, group)


def _global_norm(pairs: _Pairs, ownership: Ownership | None, group: Group) -> torch.Tensor:
    counted = _counted_grads(pairs, ownership, group)
    dtype = _norm_dtype([t.grad for _, t in pairs if t.grad is not None])  # the same on every rank
    if not is_distributed(group):
        return _local_norm(counted, dtype)
    # One scalar all_reduce of the sum of squares; squaring the local norm keeps the per-tensor
    # norms (computed like torch does) and costs one rounding, far below any clipping threshold.
    sq = _local_norm(counted, dtype).to(device_for(group), torch.float64) ** 2
    return all_reduce_sum(sq.reshape(1), group).sqrt().reshape(()).to(dtype)


def clip_grad_norm_(
    params: Params,
    max_norm: float,
    *,
    ownership: Ownership | None = None,
    group: Group = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale every gradient of ``params`` so that the global norm is at most ``max_norm``.

    The coefficient is ``max_norm / (norm + 1e-6)`` clamped to 1, exactly as
    :func:`torch.nn.utils.clip_grad_norm_`; every gradient passed is scaled,
    replicas included, so replicas stay identical. The norm is the same on every
    rank, so every rank takes the same decision (NaN included).

    Args:
        params: as for :func:`grad_norm`.
        max_norm: the largest norm allowed.
        ownership: as for :func:`grad_norm`.
        group: as for :func:`grad_norm`.
        error_if_nonfinite: raise instead of scaling when the norm is NaN or Inf (on every rank).

    Returns:
        The global norm before clipping.

    Raises:
        NonFiniteGradientError: ``error_if_nonfinite`` and the norm is NaN or Inf; raised on every rank.
        IdError, CollectiveError: as for :func:`grad_norm`.

    >>> w = torch.zeros(2, requires_grad=True)
    >>> w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm_([w], 1.0), w.grad
    (tensor(5.), tensor([0.6000, 0.8000]))
    """
    pairs = _pairs(params)
    total = _global_norm(pairs, ownership, group)
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise NonFiniteGradientError(
            f"rank {get_rank(group)}: the global gradient norm is {float(total)!r}; every rank sees the same value "
            "and raises; skip this step (zero the gradients) or pass error_if_nonfinite=False to scale anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [t.grad for t in _distinct(pairs) if t.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
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


def _counted_grads(pairs: _Pairs, ownership: Ownership | None, group: Group) -> list[torch.Tensor]:
    """The gradients this rank counts: owned shards, or all of them on rank 0 when nothing is declared."""
    rank = get_rank(group)
    if ownership is None:
        return [t.grad for t in _distinct(pairs) if t.grad is not None] if rank == 0 else []
    ownership.verify(group)
    seen: set[int] = set()
    counted = []
    for shard, t in pairs:
        if shard is None:
            raise IdError("grad_norm with an ownership needs shard ids: pass named_parameters() or a mapping")
        if shard not in ownership:
            raise IdError(f"rank {rank}: parameter {shard!r} is not declared in the ownership")
        if id(t) in seen:
            continue  # tied: the first shard id under which the tensor appears decides
        seen.add(id(t))
        if ownership.owner(shard) == rank and t.grad is not None:
            counted.append(t.grad)
    return counted


def _norm_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    dtype = torch.float32
    for g in grads:
        dtype = torch.promote_types(dtype, g.dtype)
    return dtype


def _local_norm(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The 2-norm of ``grads`` computed the way torch.nn.utils.clip_grad_norm_ does (per tensor, then stacked)."""
    if not grads:
        return torch.tensor(0.0, dtype=dtype)
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(grads[0].device, dtype) for n in norms]), 2.0)
    return total
