"""Which ranks an accumulator counts and reduces over, read from a ``DeviceMesh`` by the names of its dims.

A mesh dim is a **data** dim when the ranks along it hold different tokens: ``dp``, ``dp_replicate``,
``dp_shard``, ``cp`` (context parallel: each rank holds a part of every sequence's tokens), and the
flattened ``fsdp`` (dp_shard x cp), ``batch`` (dp_replicate x dp_shard), ``loss`` (batch x cp),
``dp_shard_cp`` and ``dp_cp`` (torchtitan's names, ``torchtitan.distributed.parallel_dims``). It is a
**replica** dim when the ranks along it hold the same tokens: ``tp`` (tensor-parallel peers compute on the
same tokens, each with its part of a weight) and ``pp`` (pipeline stages run the same microbatches through
other layers). The accumulator's group is then the ranks that differ from this one on the data dims only,
one group per coordinate on the replica dims: each valid token counts once over dp x cp, never once more
per tp peer (verl#5983 counted over dp only and missed the cp ranks' tokens: a divisor off by the cp size).

Other names are refused: which tokens their ranks hold is not in the name (``ep``'s ranks hold different
tokens in torchtitan, where expert parallel is carved out of dp_shard x cp x tp; ``sp`` is Ulysses' token
split in verl but Megatron's split of activations inside tp).

Groups: one data dim is the mesh's own group (``DeviceMesh.get_group``); the whole default world is the
default group (None); several dims are flattened into one group with public APIs (not the private
``DeviceMesh._flatten``), made once per set of ranks and kept: on a mesh over the whole world every rank
builds every data group in one order (``dist.new_subgroups_by_enumeration``); on a mesh over part of it
(one pipeline stage's) only the group's own ranks can, with ``dist.new_group(ranks,
use_local_synchronization=True)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradagg.errors import GradaggError
from gradagg.torch.accumulate.ledger import Span
from gradagg.torch.accumulate.lifetime import group_ranks
from gradagg.torch.collectives import Group, is_distributed

DATA_DIMS = ("dp", "dp_replicate", "dp_shard", "cp", "fsdp", "batch", "loss", "dp_shard_cp", "dp_cp")
"""Mesh dims whose ranks hold different tokens: counted and reduced over."""
REPLICA_DIMS = ("tp", "pp")
"""Mesh dims whose ranks hold the same tokens: one group per coordinate, never counted over."""
_REFUSED = {
    "ep": "expert-parallel ranks hold different tokens where ep is carved out of dp_shard x cp (torchtitan): pass "
    "the dense mesh, without ep",
    "efsdp": "torchtitan's efsdp spans tp ranks as well as data ranks",
    "sp": "'sp' is a split of the tokens in verl's Ulysses (name it 'cp') but of activations inside tp in Megatron "
    "(name it 'tp')",
    "world": "the world holds tensor-parallel and pipeline peers as well as data ranks",
}
_made: dict[tuple[int, ...], tuple[Any, Group]] = {}  # ranks -> (the default group then, the group made)


def span_of(mesh: Any, group: Group) -> tuple[Group, Span]:
    """The accumulator's group and its :class:`~.ledger.Span` from ``mesh`` (or from ``group`` alone).

    Args:
        mesh: a ``torch.distributed.device_mesh.DeviceMesh`` with named dims, or None.
        group: the process group given to the accumulator (None: none given); a DeviceMesh there is ``mesh``.

    Returns:
        ``(group, span)``: the group of the ranks that differ from this one on the mesh's data dims (the
        one given, when it holds the same ranks); which dims it counts over, and its global ranks.

    Raises:
        GradaggError: not a DeviceMesh; a mesh without dim names; dims of unknown or ambiguous names (all
            named, with how to name them); this rank outside the mesh; a ``group`` holding other ranks than
            the mesh's data dims (naming both).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None and isinstance(group, DeviceMesh):
        mesh, group = group, None
    if mesh is None:
        return group, Span(ranks=tuple(sorted(group_ranks(group))))
    data = data_dims(mesh)
    ranks = data_ranks(mesh, data)
    if group is not None:
        if sorted(group_ranks(group)) != list(ranks):
            raise GradaggError(
                f"MicrobatchAccumulator: group= holds global ranks {list(group_ranks(group))}, but mesh= says this "
                f"rank counts over {_dims(data)}, global ranks {list(ranks)}: pass one of them, or ones that agree"
            )
        return group, Span(ranks=tuple(ranks), counted_over=data)
    return _group_of(mesh, data, ranks), Span(ranks=tuple(ranks), counted_over=data)


def data_dims(mesh: Any) -> tuple[str, ...]:
    """The names of ``mesh``'s data dims, in its order (see the module docstring).

    Raises:
        GradaggError: not a DeviceMesh; no dim names; unknown or ambiguous names (every one named).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise GradaggError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        raise GradaggError(
            f"mesh {mesh} has no dim names: name them (init_device_mesh(..., mesh_dim_names=...)) so that gradagg "
            f"can tell the dims whose ranks hold different tokens {DATA_DIMS} from those whose ranks hold the same "
            f"{REPLICA_DIMS}"
        )
    bad = [n for n in names if n not in DATA_DIMS + REPLICA_DIMS]
    if bad:
        why = "".join(f"; {n!r}: {_REFUSED[n]}" for n in bad if n in _REFUSED)
        raise GradaggError(
            f"mesh dims {bad} of {tuple(names)}: gradagg cannot tell whether their ranks hold different tokens "
            f"(counted) or the same (not counted again){why}. Name each dim as torchtitan does: ranks holding "
            f"different tokens {DATA_DIMS}, the same tokens {REPLICA_DIMS}; or pass group=, the process group of the "
            "ranks whose tokens differ, instead of mesh="
        )
    return tuple(n for n in names if n in DATA_DIMS)


def data_ranks(mesh: Any, data: tuple[str, ...]) -> list[int]:
    """The global ranks that differ from this one on the dims ``data`` only (this rank's coordinate elsewhere), sorted.

    Raises:
        GradaggError: this rank is not in ``mesh``.
    """
    me = dist.get_rank()
    mine = [g for g in groups_along(mesh.mesh, mesh.mesh_dim_names, data) if me in g]
    if not mine:
        raise GradaggError(f"global rank {me} is not in mesh {mesh}: pass this rank's own mesh")
    return mine[0]


def groups_along(ranks: torch.Tensor, names: Sequence[str], data: Sequence[str]) -> list[list[int]]:
    """Every data group of a mesh: its ranks split by coordinate on the dims not in ``data``, each group sorted.

    Args:
        ranks: the mesh's global ranks, one dim per mesh dim (``DeviceMesh.mesh``).
        names: the mesh's dim names.
        data: the names of the data dims.

    Returns:
        The groups, in the mesh's order of the other dims' coordinates.

    >>> groups_along(torch.arange(8).reshape(2, 2, 2), ("dp", "cp", "tp"), ("dp", "cp"))
    [[0, 2, 4, 6], [1, 3, 5, 7]]
    """
    inner = [i for i, n in enumerate(names) if n in data]
    outer = [i for i, n in enumerate(names) if n not in data]
    size = math.prod(ranks.shape[i] for i in inner)
    rows = ranks.permute(*outer, *inner).reshape(-1, size).tolist()
    return [sorted(int(r) for r in row) for row in rows]


def data_group(mesh: Any) -> Group:
    """The process group an accumulator built with ``mesh=mesh`` counts and reduces over (for ``plan_window``).

    Args:
        mesh: a ``DeviceMesh`` with named dims (see the module docstring).

    Returns:
        A process group, or None for the default one.

    Raises:
        GradaggError: as :func:`span_of`.
    """
    return span_of(mesh, None)[0]


def _group_of(mesh: Any, data: tuple[str, ...], ranks: list[int]) -> Group:
    if not is_distributed() or ranks == list(range(dist.get_world_size())):
        return None
    if len(data) == 1:
        return mesh.get_group(data[0])
    key = tuple(ranks)
    made = _made.get(key)
    if made is None or made[0] is not dist.group.WORLD:  # a group of an earlier, destroyed world is no group
        made = (dist.group.WORLD, _new_group(mesh, data, ranks))
        _made[key] = made
    return made[1]


def _new_group(mesh: Any, data: tuple[str, ...], ranks: list[int]) -> Group:
    everyone = groups_along(mesh.mesh, mesh.mesh_dim_names, data)
    if sorted(r for g in everyone for r in g) == list(range(dist.get_world_size())):
        # every rank of the world builds every data group, in the mesh's order: new_group's own contract
        return dist.new_subgroups_by_enumeration(everyone)[0]  # type: ignore[no-untyped-call]
    # a mesh over part of the world (one pipeline stage's, say): only its ranks call here, so only a group's own
    # ranks may build it (named by a hash of its ranks, which another group of the same ranks would already hold)
    try:
        return dist.new_group(ranks, use_local_synchronization=True)
    except ValueError as exc:
        raise GradaggError(
            f"mesh {mesh}: the group of global ranks {ranks} ({_dims(data)}) could not be built ({exc}); pass "
            "the world's mesh, or group= that group"
        ) from None


def _dims(data: tuple[str, ...]) -> str:
    return " x ".join(data) if data else "no data dim (this rank alone)"


def check_fsdp_mesh(fsdp_mesh: Any, span: Span) -> None:
    """Refuse an FSDP2 mesh that does not span the accumulator's group: FSDP would reduce over other ranks.

    Args:
        fsdp_mesh: the mesh of the FSDP2 parameters (``DTensor.device_mesh``).
        span: the accumulator's ranks, and the data dims it counts over.

    Raises:
        GradaggError: naming both meshes and both sets of ranks.
    """
    mine = sorted(int(r) for r in fsdp_mesh.mesh.reshape(-1).tolist())
    if mine != sorted(span.ranks):
        names = fsdp_mesh.mesh_dim_names
        over = f"mesh dims {_dims(span.counted_over)}, " if span.counted_over else ""
        raise GradaggError(
            f"the FSDP2 parameters live on mesh {tuple(names) if names else fsdp_mesh} over global ranks {mine}, but "
            f"the accumulator counts over {over}global ranks {sorted(span.ranks)}: FSDP must shard over the data "
            "ranks the accumulator counts (its mesh the data mesh, e.g. dp_shard x cp flattened to dp_shard_cp)"
        )


__all__ = [
    "DATA_DIMS",
    "REPLICA_DIMS",
    "check_fsdp_mesh",
    "data_dims",
    "data_group",
    "data_ranks",
    "groups_along",
    "span_of",
]
