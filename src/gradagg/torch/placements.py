"""Who counts a DTensor's local piece: ownership read from its placements and mesh dimension names.

A DTensor lives on a mesh (``DeviceMesh``) and has one placement per mesh
dimension. For counting each element of the global tensor exactly once:

* ``Shard(d)`` on a mesh dimension: the ranks along it hold disjoint pieces
  (some possibly empty, when the size does not divide); each rank owns its piece.
* ``Replicate()``: the ranks along it hold copies; the one at coordinate 0 owns them.
* ``Partial``: each rank holds a partial sum, not a piece: the norm of a sum is
  not the sum of norms, so it is refused (reduce the gradient first).
* A mesh may be one of several copies of a sub-mesh (the ``"ep"`` rows of a
  ``("dp", "ep")`` mesh): every copy holds the same parameter, and the copy that
  contains the group's first rank owns it. This rests on every rank of the group
  holding every parameter (its own piece of it), as in data, expert and tensor
  parallelism; pipeline stages, which hold different parameters, are not covered.

A plain tensor in a process group is a replica on every rank, owned by rank 0 of
the group. Everything here is read from the local tensor and mesh, without
communication; :meth:`gradagg.torch.Ownership.from_module` gathers what every
rank read and checks that the copies fit together.

``torch.distributed.tensor`` is never imported here: a tensor can only be a
DTensor once that module is loaded, so without it every tensor is plain.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gradagg.errors import PlacementError
from gradagg.torch.collectives import Group, get_rank

ShardId = int | str
_V = TypeVar("_V")
# A mapping keyed by shard ids. Mapping is invariant in its key type, so dict[str, X] is not a
# Mapping[int | str, X]: the three forms let callers pass str-keyed, int-keyed or mixed dicts.
ShardMap = Mapping[str, _V] | Mapping[int, _V] | Mapping[ShardId, _V]


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one parameter, as :meth:`Ownership.from_module` gathers it.

    Attributes:
        name: the parameter's name in the module.
        description: what every rank must agree on (kind, global shape, dtype, placements, mesh shape and names).
        shard: the shard id of this rank's piece (the name, plus the coordinates along ``Shard`` dimensions).
        counts: whether this rank owns its piece (counts it in a norm).
        local_shape: the shape of this rank's piece.
        dtype: the parameter's dtype.
        mesh_ranks: the global ranks of this rank's copy of the mesh (empty for a plain tensor).
        error: why the piece cannot be counted, or None.
    """

    name: str
    description: str
    shard: ShardId
    counts: bool
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    mesh_ranks: tuple[int, ...]
    error: str | None


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as messages and layout checks write it: ``float32``, not ``torch.float32``.

    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``, without importing that module.

    >>> is_dtensor(torch.zeros(2))
    False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor``: ``to_local()`` of a DTensor (sharing its storage), else ``tensor`` itself.

    >>> local_tensor(torch.ones(2))
    tensor([1., 1.])
    """
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined, no-any-return]


def shard_id(name: str, tensor: torch.Tensor) -> ShardId:
    """The shard id of this rank's piece of ``tensor``: what :meth:`Ownership.from_module` declares it as.

    A plain tensor, or a DTensor replicated on every mesh dimension, is one shard named ``name``. A
    sharded DTensor has one shard per coordinate along its ``Shard`` dimensions, named with the mesh
    dimension names, e.g. ``"experts.w_in[ep=1]"`` (an unnamed dimension ``i`` is ``dim<i>``).

    Args:
        name: the parameter's name.
        tensor: the parameter (or its gradient: the same placements).

    Returns:
        The shard id.

    Raises:
        PlacementError: this rank is not in the DTensor's mesh.

    >>> shard_id("router.weight", torch.zeros(2))
    'router.weight'
    """
    if not is_dtensor(tensor):
        return name
    mesh, placements = _mesh_and_placements(tensor)
    coords = _coordinate(mesh)
    names = _dim_names(mesh)
    sharded = [f"{names[i]}={coords[i]}" for i, p in enumerate(placements) if p.is_shard()]
    return f"{name}[{','.join(sharded)}]" if sharded else name


def counts_here(tensor: torch.Tensor, group: Group = None) -> bool:
    """Whether this rank owns its piece of ``tensor`` (and so counts it once in a norm).

    Args:
        tensor: a parameter or gradient, plain or DTensor.
        group: the process group the count runs over (None: the default group).

    Returns:
        For a plain tensor: this is rank 0 of ``group`` (or there is no group). For a DTensor: this
        rank's mesh copy contains the group's first rank and its coordinate is 0 on every
        ``Replicate`` dimension.

    Raises:
        PlacementError: a ``Partial`` or unsupported placement, a mesh that does not contain this rank,
            or a mesh with ranks outside ``group``.

    >>> counts_here(torch.zeros(2))
    True
    """
    if not is_dtensor(tensor):
        return get_rank(group) == 0
    mesh, placements = _mesh_and_placements(tensor)
    coords = _coordinate(mesh)
    ranks = _mesh_ranks(mesh)
    members = _group_ranks(group)
    outside = sorted(set(ranks) - set(members))
    if outside:
        raise PlacementError(f"the mesh holds rank(s) {outside}, which are not in the process group {members}")
    replicated_at_zero = all(coords[i] == 0 for i, p in enumerate(placements) if p.is_replicate())
    return replicated_at_zero and min(members) in ranks


def piece_of(name: str, tensor: torch.Tensor, group: Group = None) -> Piece:
    """What this rank holds of parameter ``name``; never raises (a problem is recorded in ``error``).

    Args:
        name: the parameter's name.
        tensor: the parameter.
        group: the process group the ownership is for.

    Returns:
        The :class:`Piece`, to be gathered from every rank.

    >>> piece_of("w", torch.zeros(2, 3)).description
    'plain (shape=(2, 3), dtype=float32)'
    """
    shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
    if not is_dtensor(tensor):
        plain = f"plain (shape={shape}, dtype={dtype})"
        return Piece(name, plain, name, counts_here(tensor, group), shape, tensor.dtype, (), None)
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)  # type: ignore[attr-defined]
    description = (
        f"DTensor (shape={shape}, dtype={dtype}, placements={tuple(placements)!r}, "
        f"mesh {tuple(mesh.mesh.shape)} {_dim_names(mesh)})"
    )
    try:
        sid, counts = shard_id(name, tensor), counts_here(tensor, group)
    except PlacementError as exc:
        return Piece(name, description, name, False, (), tensor.dtype, _mesh_ranks(mesh), f"parameter {name!r}: {exc}")
    local_shape = tuple(local_tensor(tensor).shape)
    return Piece(name, description, sid, counts, local_shape, tensor.dtype, _mesh_ranks(mesh), None)


def owners_from_pieces(tables: list[list[Piece]]) -> dict[ShardId, tuple[tuple[int, ...], torch.dtype, int]]:
    """Each shard's (local shape, dtype, owner rank) from every rank's pieces (index = rank in the group).

    The tables must already agree on names and descriptions. Checked here: no piece has an error;
    two ranks' copies of a mesh are the same ranks or disjoint; every shard has exactly one owner;
    every rank's piece of a shard has the owner's shape.

    Args:
        tables: ``tables[r]`` is the list of rank r's pieces, in the same order on every rank.

    Returns:
        shard id -> (shape, dtype, owner), for every shard of every parameter.

    Raises:
        PlacementError: naming the parameter, the ranks and both values.

    >>> owners_from_pieces([[piece_of("w", torch.zeros(2))]])
    {'w': ((2,), torch.float32, 0)}
    """
    out: dict[ShardId, tuple[tuple[int, ...], torch.dtype, int]] = {}
    for column in zip(*tables):
        out.update(_owners_of_one(list(column)))
    return out


def _owners_of_one(pieces: list[Piece]) -> dict[ShardId, tuple[tuple[int, ...], torch.dtype, int]]:
    errors = [f"rank {r}: {p.error}" for r, p in enumerate(pieces) if p.error is not None]
    if errors:
        raise PlacementError("; ".join(errors))
    name = pieces[0].name
    _check_copies(name, [p.mesh_ranks for p in pieces])
    owners: dict[ShardId, tuple[tuple[int, ...], torch.dtype, int]] = {}
    for rank, p in enumerate(pieces):
        if p.counts:
            if p.shard in owners:
                raise PlacementError(
                    f"parameter {name!r}: shard {p.shard!r} is owned by ranks {owners[p.shard][2]} "
                    f"and {rank}; each shard must have exactly one owner"
                )
            owners[p.shard] = (p.local_shape, p.dtype, rank)
    for rank, p in enumerate(pieces):
        if p.shard not in owners:
            raise PlacementError(f"parameter {name!r}: rank {rank} holds shard {p.shard!r}, which no rank owns")
        shape, _, owner = owners[p.shard]
        if p.local_shape != shape:
            raise PlacementError(
                f"parameter {name!r}: rank {rank} holds shard {p.shard!r} with shape "
                f"{p.local_shape}, but its owner rank {owner} holds shape {shape}"
            )
    return owners


def _check_copies(name: str, copies: list[tuple[int, ...]]) -> None:
    """Copies of a mesh are the same ranks or disjoint ones (plain tensors have none)."""
    distinct = sorted(set(copies))
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            if set(a) & set(b):
                raise PlacementError(
                    f"parameter {name!r}: meshes {list(a)} and {list(b)} share ranks "
                    f"{sorted(set(a) & set(b))} without being the same mesh"
                )


# --- reading a DTensor and a group (public torch APIs only) ------------------------------


def _mesh_and_placements(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)  # type: ignore[attr-defined]
    for i, p in enumerate(placements):
        if p.is_partial():
            raise PlacementError(
                f"placement {p!r} on mesh dimension {_dim_names(mesh)[i]!r} holds partial sums, not a piece: "
                "reduce the gradient first (e.g. grad.redistribute(placements=[Replicate()]))"
            )
        if not (p.is_shard() or p.is_replicate()):
            raise PlacementError(
                f"placement {p!r} on mesh dimension {_dim_names(mesh)[i]!r} is not supported (only Shard and Replicate)"
            )
    return mesh, placements


def _coordinate(mesh: Any) -> tuple[int, ...]:
    coords = mesh.get_coordinate()
    if coords is None:
        raise PlacementError(f"this rank is not in the mesh {_mesh_ranks(mesh)}: it holds no piece to count")
    return tuple(coords)


def _dim_names(mesh: Any) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    return tuple(names) if names else tuple(f"dim{i}" for i in range(mesh.ndim))


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def _group_ranks(group: Group) -> list[int]:
    """The global ranks of ``group`` (``[0]`` with no process group; a group of one names its own rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [0]

    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
