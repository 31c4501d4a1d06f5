"""DTensor gradients (FSDP2, HSDP, tensor parallel): each rank's shard, put together in the checking process.

A rank does not gather its DTensor gradients itself (``full_tensor()`` is a collective): it hands back
a :class:`Piece`, its local tensor with the DTensor's placements, mesh and coordinate, and
:func:`assemble` builds, for every rank, the whole tensor that rank's DTensor stands for. No
collective runs after ``step()``, so a world the step left with unmatched collectives, or a rank
that left a shard None, cannot turn the reading into a hang or a lost peer: the gradient that does not
fit is named instead (:class:`~gradagg.parity.compare.Unread`).

Placements, written as DTensor writes them short: ``S(d)`` (``Shard(d)``: the ranks along that mesh
dimension hold consecutive ``torch.chunk`` pieces of dim d, the last ones shorter or empty), ``R``
(``Replicate()``: each rank's own tensor is the whole, not checked against its replicas: every rank
is compared with the truth anyway), ``P(sum)`` (``Partial("sum")``: the whole is the sum of the pieces).
Mesh dimensions are undone from the last to the first, the reverse of the order DTensor shards in.
Any other placement (``_StridedShard``, a partial mean, max or min) is not guessed at: it is Unread.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gradagg.parity.types import FlatPiece, Piece, Unread

if TYPE_CHECKING:
    import torch

_SHARD = re.compile(r"S\((\d+)\)")


def piece_of(grad: Any) -> Piece:
    """A DTensor gradient as this rank's :class:`Piece`, without communication (``to_local()``, copied to CPU).

    Args:
        grad: a ``torch.distributed.tensor.DTensor``.

    Returns:
        Its local tensor, whole shape, placements (short form), mesh and this rank's coordinate in it.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    def short(p: Any) -> str:  # exact types: _StridedShard and _MaskPartial are not what their names say
        if type(p) is Shard:
            return f"S({p.dim})"
        if type(p) is Replicate:
            return "R"
        return "P(sum)" if type(p) is Partial and p.reduce_op == "sum" else repr(p)

    mesh = grad.device_mesh
    return Piece(grad.to_local().detach().to("cpu", copy=True), tuple(grad.shape),
                 tuple(short(p) for p in grad.placements), tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                 tuple(mesh.mesh.shape), tuple(mesh.get_coordinate()))


def assemble(results: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Replace every :class:`Piece` by the whole tensor its rank's DTensor stands for, or by an Unread (and every
    :class:`FlatPiece` by its FSDP1 gradient's whole, :func:`gradagg.parity.fsdp1.whole`).

    Args:
        results: rank -> parameter name -> a gradient (tensor, Piece, or None), for the ranks that returned.

    Returns:
        The same, each Piece replaced; tensors and None pass through.

    A bias of 2 entries, one on each of 2 ranks (``Shard(0)``): both ranks see the whole.

    >>> import torch
    >>> halves = [Piece(torch.tensor([r + 1.0]), (2,), ("S(0)",), (0, 1), (2,), (r,)) for r in (0, 1)]
    >>> assemble({r: {"bias": halves[r]} for r in (0, 1)})[0]["bias"]
    tensor([1., 2.])
    """
    return {rank: {name: _assembled(name, rank, g, results) for name, g in grads.items()}
            for rank, grads in results.items()}


def _assembled(name: str, rank: int, g: Any, results: Mapping[int, Mapping[str, Any]]) -> Any:
    if isinstance(g, Piece):
        return _whole(name, rank, g, results)
    if isinstance(g, FlatPiece):
        from gradagg.parity.fsdp1 import whole

        return whole(name, g, results)
    return g


def _whole(name: str, rank: int, piece: Piece, results: Mapping[int, Mapping[str, Any]]) -> torch.Tensor | Unread:
    here = f"{name!r} is a DTensor gradient ({', '.join(piece.placements)}) here but"
    unknown = [p for p in piece.placements if p != "R" and p != "P(sum)" and not _SHARD.fullmatch(p)]
    if unknown:
        return Unread(f"{here} its placement {unknown[0]} is not one parity assembles (Shard, Replicate, Partial sum)")
    pieces: dict[tuple[int, ...], torch.Tensor] = {}
    for r in piece.mesh:
        other = results.get(r, {}).get(name)
        if not (isinstance(other, Piece) and other.spec == piece.spec):
            return Unread(f"{here} {_unlike(other, piece)} on rank {r}: the shards of a gradient must be on every "
                          "rank of its mesh, alike (did step() leave it None, or replace it, on some rank?)")
        pieces[other.coordinate] = other.local
    try:
        for dim in reversed(range(len(piece.mesh_shape))):
            pieces = {c: _undo(pieces, c, dim, piece) for c in pieces}
    except (RuntimeError, KeyError, IndexError) as exc:  # shards whose other dims differ, or coordinates off
        return Unread(f"{here} its shards do not fit together: {type(exc).__name__}: {exc}")
    whole = pieces[piece.coordinate]
    if tuple(whole.shape) != piece.shape:
        return Unread(f"{here} its shards assemble to shape {list(whole.shape)}, not the DTensor's "
                      f"{list(piece.shape)}: each rank's local shard is not its torch.chunk rows")
    return whole


def _undo(pieces: Mapping[tuple[int, ...], torch.Tensor], c: tuple[int, ...], dim: int, piece: Piece) -> torch.Tensor:
    """Coordinate c's tensor once mesh dimension ``dim`` is undone (its pieces along that dimension combined)."""
    import torch

    placement = piece.placements[dim]
    if placement == "R":
        return pieces[c]
    along = [pieces[c[:dim] + (k,) + c[dim + 1:]] for k in range(piece.mesh_shape[dim])]
    if placement == "P(sum)":
        return torch.stack(along).sum(0)
    match = _SHARD.fullmatch(placement)
    if match is None:  # _whole lets only S(d), R and P(sum) through
        raise KeyError(f"placement {placement}")
    return torch.cat(along, dim=int(match[1]))


def _unlike(other: Any, piece: Piece) -> str:
    if other is None:
        return "has none"
    if not isinstance(other, Piece):
        return "a plain tensor"
    mesh = "" if other.mesh == piece.mesh and other.mesh_shape == piece.mesh_shape else \
        f" on the mesh {list(other.mesh)} of shape {list(other.mesh_shape)}"
    return f"a DTensor ({', '.join(other.placements)}) of shape {list(other.shape)}{mesh}"
