"""Which parameters an accumulator owns, from a module, a DDP or FSDP2 model, or tensors; and whether that changed."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel

from gradagg.errors import GradaggError
from gradagg.torch.placements import is_dtensor

ParamSource = torch.nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class Params:
    """The accumulated parameters (those with ``requires_grad`` when the accumulator was built).

    Attributes:
        names: one name per parameter (``named_parameters()`` names, or ``param[k]`` for bare tensors).
        tensors: the parameters; under FSDP2 the sharded DTensors the optimizer holds.
        module: the module they came from (None for tensors), re-read to notice changes.
        ddp: the DDP wrapper, if the source was one.
        frozen: parameters seen without ``requires_grad`` (a tensor source), to notice one unfrozen later.
        unnamed: indices of the parameters given as bare tensors (named ``param[k]`` by their position).
        local: trainable parameters in DDP's ``parameters_to_ignore``: DDP keeps them rank-local, so they are not
            accumulated (see :mod:`.wrappers.ddp`).
        fsdp1: the outermost FSDP1 units of the module (see :mod:`.wrappers.fsdp1`); empty without FSDP1.
    """

    names: list[str]
    tensors: list[torch.Tensor]
    module: torch.nn.Module | None = None
    ddp: DistributedDataParallel | None = None
    frozen: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    unnamed: set[int] = field(default_factory=set)
    local: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    fsdp1: list[torch.nn.Module] = field(default_factory=list)

    @classmethod
    def collect(cls, source: ParamSource) -> Params:
        """Read the parameters of ``source``; a tensor given twice (tied weights) is one parameter.

        Raises:
            GradaggError: an item that is neither a tensor nor a ``(name, tensor)`` pair.
        """
        ddp = source if isinstance(source, DistributedDataParallel) else None
        module = ddp.module if ddp is not None else (source if isinstance(source, torch.nn.Module) else None)
        items: Iterable[object] = module.named_parameters() if module is not None else source  # type: ignore[assignment]
        out = cls([], [], module, ddp)
        out.fsdp1 = fsdp1_roots(module) if module is not None else []
        ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))  # DDP's own: rank-local, never reduced
        seen: set[int] = set()
        for k, item in enumerate(items):
            name, t = (f"param[{k}]", item) if isinstance(item, torch.Tensor) else _pair(item)
            if not isinstance(t, torch.Tensor):
                kind = type(item).__name__
                raise GradaggError(f"expected a module, tensors or (name, tensor) pairs; item {k} is {kind}")
            if id(t) in seen:
                continue
            if not out.fsdp1 and getattr(t, FSDP1_FLATTENED, False):
                raise GradaggError(f"parameter {name!r} is flattened into FullyShardedDataParallel (FSDP1), which the "
                                   "accumulator was not given (it was given the module inside, or its parameters): "
                                   "give the accumulator the wrapped module: MicrobatchAccumulator(fsdp_model)")
            if module is None and FSDP1_PREFIX in name.split("."):
                raise GradaggError(f"parameter {name!r} belongs to an FSDP1 unit: pass the FSDP1 module itself "
                                   "(FullyShardedDataParallel), not its parameters: gradagg reduces through its hook")
            seen.add(id(t))
            if t.requires_grad and name in ignored:
                out.local.append((name, t))
            elif t.requires_grad:
                if isinstance(item, torch.Tensor):
                    out.unnamed.add(len(out.tensors))
                out.names.append(name)
                out.tensors.append(t)
            else:
                out.frozen.append((name, t))
        return out

    def shape_text(self, i: int) -> str:
        """Parameter ``i``'s shape as the ranks compare it: FSDP1's pieces differ per rank, so they are not compared."""
        return "FSDP1 piece" if self.fsdp1 else str(tuple(self.tensors[i].shape))

    @property
    def sharded(self) -> list[int]:
        """Indices of the FSDP2 (DTensor) parameters."""
        return [i for i, t in enumerate(self.tensors) if is_dtensor(t)]

    def changed(self) -> str | None:
        """Why the trainable parameters are no longer the ones accumulated (None if they are).

        A parameter unfrozen (or replaced) after construction would get gradients that are neither reduced
        nor divided: every rank would keep its own. FSDP2 parameters are compared by name (the tensor
        registered under it changes between sharded and unsharded), every other one by identity, plain
        parameters beside FSDP ones included.
        """
        for name, t in self.frozen:
            if t.requires_grad:
                return f"parameter {name!r} was frozen when the accumulator was built and now requires grad"
        if self.module is None:
            return None
        by_name = {self.names[i] for i in self.sharded}
        local = {n for n, _ in self.local}
        now = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and n not in local]
        mine = dict(zip(self.names, self.tensors))
        for n, p in now:
            if n not in mine or (n not in by_name and mine[n] is not p):
                return f"parameter {n!r} requires grad but is not among the accumulated ones (unfrozen or replaced)"
        return None


FSDP1_PREFIX = "_fsdp_wrapped_module"  # the attribute FSDP1 holds its module under (in every parameter's name)
# Private: FSDP1 marks every parameter it flattened with this attribute (torch.distributed.fsdp._common_utils.
# _set_fsdp_flattened); no public API tells a module inside an FSDP1 unit. Where it is missing, the ranks' differing
# pieces are refused by the layout check instead (a CollectiveError comparing their shapes).
FSDP1_FLATTENED = "_fsdp_flattened"


def fsdp1_class() -> type[torch.nn.Module] | None:
    """FSDP1's class where the user imported it (None otherwise: then no module of it can exist).

    >>> fsdp1_class() is None or fsdp1_class().__name__ == "FullyShardedDataParallel"
    True
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FullyShardedDataParallel", None)


def fsdp1_roots(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost FSDP1 units in ``module`` (``module`` itself if it is one); empty without FSDP1.

    >>> fsdp1_roots(torch.nn.Linear(1, 1))
    []
    """
    cls = fsdp1_class()
    if cls is None:
        return []
    units = [name for name, m in module.named_modules() if isinstance(m, cls)]

    def inside(name: str, other: str) -> bool:
        return other != name and (other == "" or name.startswith(other + "."))

    outer = {name for name in units if not any(inside(name, other) for other in units)}
    return [m for name, m in module.named_modules() if name in outer]


def _pair(item: object) -> tuple[str, object]:
    if isinstance(item, tuple) and len(item) == 2:
        return str(item[0]), item[1]
    return "?", item


__all__ = ["ParamSource", "Params"]
