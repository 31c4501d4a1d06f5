"""FSDP1 gradients (``FullyShardedDataParallel``): each rank's piece of each parameter, put together in the checking
process, as DTensor shards are (:mod:`gradagg.parity.shards`).

With ``use_orig_params=True`` (the HF Trainer's, Accelerate's and Lightning's default) FSDP1 keeps the model's own
parameters: each is then the 1-d part of its flattened self that falls in this rank's piece of its unit's flat
parameter, and its ``.grad`` the same part of the gradient (``.grad`` None where the part is empty). FSDP1 shards a
flat parameter in consecutive pieces in its group's rank order, and a parameter occupies one contiguous range of
it, so the ranks' parts, concatenated in that order, are the whole gradient flattened. No private FSDP1 API is
needed: the whole shape is read before ``prepare`` wraps the model, and a parameter's name after wrapping only gains
FSDP1's ``_fsdp_wrapped_module.`` segments. The group is the unit's ``process_group`` (under the hybrid strategies
one replica's ranks; each replica holds the whole).

With ``use_orig_params=False`` the model's parameters are replaced by FSDP1's flat parameters, whose split into
the model's parameters only FSDP1's private layout knows: every parameter is then Unread, naming the setting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gradagg.parity.types import FlatPiece, Unread

if TYPE_CHECKING:
    import torch

WRAPPED = "_fsdp_wrapped_module."  # the segment FSDP1 inserts in the names of the modules it wraps


def fsdp1_in(wrapped: Any) -> Any:
    """The first FSDP1 unit in what ``prepare`` returned (itself, or one inside it), or None (no FSDP1)."""
    from gradagg.torch.accumulate.params import fsdp1_class

    cls = fsdp1_class()
    modules = wrapped.modules() if hasattr(wrapped, "modules") else ()
    return next((m for m in modules if cls is not None and isinstance(m, cls)), None)


def read(model: Any, unit: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, FlatPiece | Unread]:
    """This rank's pieces of every parameter of ``model`` (the model ``build_model()`` gave), by its own name.

    Args:
        model: the model, wrapped in place by FSDP1.
        unit: an FSDP1 unit of it (:func:`fsdp1_in`): its group is the pieces' group.
        shapes: every parameter's name and whole shape, read before ``prepare``.
    """
    import torch.distributed as dist

    group = getattr(unit, "process_group", None)  # FSDP1's attribute (its sharding group)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    now = {name.replace(WRAPPED, ""): p for name, p in model.named_parameters()}
    flat = [name for name in now if name not in shapes]
    out: dict[str, FlatPiece | Unread] = {}
    for name, shape in shapes.items():
        p = now.get(name)
        if p is None:
            out[name] = Unread(
                f"{name!r} is no longer a parameter of the model under FSDP1 (it holds {len(flat)} flat parameter(s), "
                f"e.g. {flat[0]!r}): with use_orig_params=False FSDP1 keeps the gradients in flat parameters, whose "
                "split into the model's parameters only FSDP1's private layout knows; use use_orig_params=True"
                if flat else f"{name!r} is no longer a parameter of the model once prepare() wrapped it in FSDP1")
            continue
        grad = p.grad
        out[name] = FlatPiece(None if grad is None else grad.detach().reshape(-1).to("cpu", copy=True),
                              p.numel(), tuple(shape), ranks)
    return out


def whole(name: str, piece: FlatPiece, results: Mapping[int, Mapping[str, Any]]) -> torch.Tensor | Unread | None:
    """The whole gradient from the pieces of ``piece``'s group (None where every rank's is None), or an Unread."""
    import torch

    pieces = [results.get(r, {}).get(name) for r in piece.group]
    here = f"{name!r} is an FSDP1 gradient in pieces over ranks {list(piece.group)}"
    if not all(isinstance(p, FlatPiece) and p.group == piece.group and p.shape == piece.shape for p in pieces):
        return Unread(f"{here}, but not on every one of them alike")
    held = [p for p in pieces if p.size]  # type: ignore[union-attr]
    if all(p.local is None for p in held):  # type: ignore[union-attr]
        return None
    missing = [r for r, p in zip(piece.group, pieces) if p.size and p.local is None]  # type: ignore[union-attr]
    if missing:
        return Unread(f"{here}, but its piece on rank(s) {missing} has no gradient while the others have one")
    parts = [p.local for p in held]  # type: ignore[union-attr]
    total = sum(int(t.numel()) for t in parts)  # type: ignore[union-attr]
    if total != math.prod(piece.shape):
        return Unread(f"{here}, whose pieces hold {total} elements, not the {math.prod(piece.shape)} of its shape "
                      f"{list(piece.shape)}")
    return torch.cat(parts).reshape(piece.shape)  # type: ignore[arg-type]


__all__ = ["WRAPPED", "fsdp1_in", "read", "whole"]
