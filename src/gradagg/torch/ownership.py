"""Declared ownership: which rank owns each shard, checked across ranks before any data moves.

An :class:`Ownership` is the one statement of which rank owns each shard (see
:mod:`gradagg.reference` for the vocabulary). A replicated parameter has one
owner; a sharded one (an expert, a tensor-parallel slice) is owned by the rank
that holds it. Every rank declares the *whole* table, including shards it does
not hold, because the owner-only reduction lays out one buffer from it.

Before any gradient moves, :meth:`Ownership.verify` checks that every rank of
the group declared the same shards, shapes, dtypes and owners (one small
``all_gather_object`` per declaration and group, cached; a second one only when
the digests differ, to name the values).
:func:`~gradagg.torch.reduce.owner_reduce` and :func:`~gradagg.torch.norm.grad_norm`
call it for you on first use.

:meth:`Ownership.from_module` reads the table from a module's parameters instead
of a declaration: DTensor placements and mesh dimension names say who owns each
piece (see :mod:`gradagg.torch.placements`), and plain tensors are replicas owned
by rank 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from gradagg.errors import CollectiveError, IdError
from gradagg.torch.buffers import ReusableBuffer
from gradagg.torch.collectives import (
    Group,
    all_gather_object,
    check_same_on_all_ranks,
    get_world_size,
    is_distributed,
)
from gradagg.torch.placements import Piece, ShardId, ShardMap, dtype_name, owners_from_pieces, piece_of


@dataclass(frozen=True)
class ShardSpec:
    """What every rank declares about one shard.

    Attributes:
        shape: the shard's gradient shape.
        dtype: the shard's gradient dtype.
        owner: the rank (within the group) whose contribution counts.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: int

    def __post_init__(self) -> None:
        # torch.Size, lists and tuples describe one shape: one form, so that ranks compare equal
        if isinstance(self.shape, (list, tuple)):
            object.__setattr__(self, "shape", tuple(self.shape))

    def describe(self) -> str:
        """``(shape=(4, 3), dtype=float32, owner=0)``: the form mismatch messages use."""
        return f"(shape={self.shape}, dtype={dtype_name(self.dtype)}, owner={self.owner})"


class Ownership:
    """Which rank owns each shard, with the shard's shape and dtype; the same on every rank.

    Args:
        shards: shard id -> :class:`ShardSpec`. Shard ids are ``int`` or ``str``.

    Attributes:
        pools: the flat buffers :func:`~gradagg.torch.owner_reduce` lays this declaration out in (all_reduce;
            gather input; gather output), reused by its next call while no result of the last is alive.

    Raises:
        IdError: ``shards`` is not a mapping, or a shard id, spec or owner of the wrong type, or a negative owner.

    >>> own = Ownership.from_tensors({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, owners={"w": 0, "b": 0})
    >>> own.owner("w"), own.spec("b").shape, list(own)
    (0, (3,), ['b', 'w'])
    """

    def __init__(self, shards: ShardMap[ShardSpec]) -> None:
        given = _mapping(shards, "shards", "shard id -> ShardSpec")
        for shard, spec in given.items():
            _check_declaration(shard, spec)
        # One canonical order on every rank (ints before strings, then by value): the buffer layout.
        self._order: tuple[ShardId, ...] = tuple(sorted(given, key=_shard_key))
        self._specs: dict[ShardId, ShardSpec] = {s: given[s] for s in self._order}
        self._verified: list[object] = []  # groups this declaration was verified on
        # owner_reduce's flat buffers (all_reduce; gather input; gather output), reused while free
        self.pools = (ReusableBuffer(), ReusableBuffer(), ReusableBuffer())

    @classmethod
    def from_tensors(cls, tensors: ShardMap[torch.Tensor], owners: ShardMap[int] | int) -> Ownership:
        """Declare ownership from example tensors (parameters or gradients) and their owners.

        Args:
            tensors: shard id -> a tensor with the shard's shape and dtype (its values are not read).
            owners: shard id -> owner rank, or one rank owning every shard.

        Returns:
            The declaration.

        Raises:
            IdError: ``tensors`` or ``owners`` is not a mapping (or a rank), a value is not a tensor, or a shard has
                no owner in ``owners``.

        >>> Ownership.from_tensors({0: torch.zeros(2)}, owners=0).spec(0)
        ShardSpec(shape=(2,), dtype=torch.float32, owner=0)
        """
        specs: dict[ShardId, ShardSpec] = {}
        given = _mapping(tensors, "tensors", "shard id -> tensor")
        if not isinstance(owners, int):
            _mapping(owners, "owners", "shard id -> owner rank, or one rank for every shard")
        for shard, tensor in given.items():
            if not isinstance(tensor, torch.Tensor):
                raise IdError(f"shard {shard!r}: expected a tensor, got {type(tensor).__name__} {tensor!r}")
            if isinstance(owners, int):
                owner = owners
            elif shard in owners:
                owner = cast(Mapping[ShardId, int], owners)[shard]
            else:
                raise IdError(f"shard {shard!r} has no owner in the owners mapping (owners given for {sorted(owners)})")
            specs[shard] = ShardSpec(tuple(tensor.shape), tensor.dtype, owner)
        return cls(specs)

    @classmethod
    def from_module(cls, module: torch.nn.Module, group: Group = None) -> Ownership:
        """Read ownership from ``module``'s parameters: DTensor placements, else replicas owned by rank 0.

        A collective: call it on every rank of ``group`` at the same point, with the same model. Each
        parameter is one shard (id: its name) owned by rank 0, except a sharded DTensor, which has one
        shard per coordinate along its ``Shard`` mesh dimensions (id ``"name[ep=1]"``, see
        :func:`gradagg.torch.placements.shard_id`), owned by the rank that holds it in the mesh copy
        containing the group's first rank, at coordinate 0 on its ``Replicate`` dimensions. Tied
        parameters are declared under each of their names (either form of ``named_parameters`` works).
        The result is identical on every rank by construction and already verified for ``group``.

        Args:
            module: the model, on every rank (DTensor parameters as ``distribute_tensor`` or FSDP2 made them).
            group: a process group, or None for the default one (no group: every parameter owned by rank 0).

        Returns:
            The declaration, with each shard's local shape and dtype.

        Raises:
            CollectiveError: on every rank, when the ranks' parameters differ (names, shapes, dtypes,
                placements or meshes), naming both ranks and both descriptions.
            PlacementError: on every rank, for a ``Partial`` or unsupported placement, a rank outside its
                mesh, or mesh copies that overlap; naming the parameter and the ranks.

        >>> Ownership.from_module(torch.nn.Linear(2, 1)).spec("weight")
        ShardSpec(shape=(1, 2), dtype=torch.float32, owner=0)
        """
        pieces = [piece_of(name, p, group) for name, p in module.named_parameters(remove_duplicate=False)]
        check_same_on_all_ranks([(p.name, p.description) for p in pieces], "parameters", group)
        owners = owners_from_pieces(cast(list[list[Piece]], all_gather_object(pieces, group)))
        ownership = cls({s: ShardSpec(shape, dtype, owner) for s, (shape, dtype, owner) in owners.items()})
        ownership._verified.append(_group_key(group))  # every rank built it from the same gathered pieces
        return ownership

    def __iter__(self) -> Iterator[ShardId]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, shard: object) -> bool:
        return shard in self._specs

    def __repr__(self) -> str:
        return f"Ownership({self._specs!r})"

    def spec(self, shard: ShardId) -> ShardSpec:
        """The declaration of ``shard``.

        Raises:
            IdError: ``shard`` is not declared.
        """
        if shard not in self._specs:
            raise IdError(f"shard {shard!r} is not declared in the ownership ({len(self)} shards declared)")
        return self._specs[shard]

    def owner(self, shard: ShardId) -> int:
        """The rank that owns ``shard``.

        Raises:
            IdError: ``shard`` is not declared.
        """
        return self.spec(shard).owner

    def owned_by(self, rank: int) -> list[ShardId]:
        """The shards ``rank`` owns, in the canonical order.

        >>> Ownership.from_tensors({"a": torch.zeros(1), "b": torch.zeros(1)}, {"a": 1, "b": 0}).owned_by(1)
        ['a']
        """
        return [s for s in self._order if self._specs[s].owner == rank]

    def verify(self, group: Group = None) -> None:
        """Check that every rank of ``group`` declared exactly this ownership; once per group.

        One ``all_gather_object`` of a digest (a second one, of the full
        declarations, only when digests differ, so that the message can name
        the values). Every rank sees the same gathered data, so every rank
        raises the same error. Owners must be ranks of the group.

        Args:
            group: a process group, or None for the default one (no group: one rank, no communication).

        Raises:
            CollectiveError: on every rank, naming the ranks, the shard and both declarations;
                or an owner that is not a rank of the group.

        >>> Ownership.from_tensors({"w": torch.zeros(1)}, owners=0).verify()
        """
        key = _group_key(group)
        if any(k is key for k in self._verified):
            return
        entries: list[tuple[object, str]] = [(s, sp.describe()) for s, sp in self._specs.items()]
        check_same_on_all_ranks(entries, "ownership declarations", group)
        _check_owners_in_group(self, get_world_size(group))
        self._verified.append(key)


# --- declaration helpers -----------------------------------------------------


def numel(shape: tuple[int, ...]) -> int:
    """The number of elements of ``shape`` (1 for ``()``)."""
    n = 1
    for d in shape:
        n *= d
    return n


def _shard_key(shard: ShardId) -> tuple[int, int, str]:
    return (0, shard, "") if isinstance(shard, int) else (1, 0, shard)


def _group_key(group: Group) -> object:
    if group is not None:
        return group
    import torch.distributed as dist

    return dist.group.WORLD if is_distributed() else _NO_GROUP


_NO_GROUP = object()  # the key for "no process group": verified once, like a group


def _mapping(value: object, name: str, expected: str) -> Mapping[Any, Any]:
    """``value`` itself if it is a mapping; else an IdError naming the argument, what it expects and what it got."""
    if not isinstance(value, Mapping):
        raise IdError(f"{name}: expected a mapping of {expected}, got {type(value).__name__} {value!r}")
    return value


def _check_declaration(shard: object, spec: object) -> None:
    if isinstance(shard, bool) or not isinstance(shard, (int, str)):
        raise IdError(f"shard id must be an int or a string, got {type(shard).__name__} {shard!r}")
    if not isinstance(spec, ShardSpec):
        raise IdError(f"shard {shard!r}: expected a ShardSpec, got {type(spec).__name__} {spec!r}")
    shape = spec.shape
    if not isinstance(shape, tuple) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise IdError(f"shard {shard!r}: shape must be a tuple of non-negative ints, got {shape!r}")
    if not isinstance(spec.dtype, torch.dtype):
        raise IdError(f"shard {shard!r}: dtype must be a torch.dtype, got {type(spec.dtype).__name__} {spec.dtype!r}")
    if isinstance(spec.owner, bool) or not isinstance(spec.owner, int) or spec.owner < 0:
        raise IdError(f"shard {shard!r}: owner must be a non-negative rank, got {spec.owner!r}")


def _check_owners_in_group(ownership: Ownership, world: int) -> None:
    for shard in ownership:
        owner = ownership.owner(shard)
        if owner >= world:
            raise CollectiveError(
                f"shard {shard!r} is declared with owner rank {owner}, "
                f"but the group has {world} rank(s) (0..{world - 1})"
            )
