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
    """

    names: list[str]
    tensors: list[torch.Tensor]
    module: torch.nn.Module | None = None
    ddp: DistributedDataParallel | None = None
    frozen: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    unnamed: set[int] = field(default_factory=set)
    local: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def collect(cls, source: ParamSource) -> Params:
        """Read the parameters of ``source``; a tensor given twice (tied weights) is one parameter.

        Raises:
            GradaggError: an item that is neither a tensor nor a ``(name, tensor)`` pair.
        """
        ddp = source if isinstance(source, DistributedDataParallel) else None
        module = ddp.module if ddp is not None else (source if isinstance(source, torch.nn.Module) else None)
        if module is not None:
            _refuse_fsdp1(module)
        items: Iterable[object] = module.named_parameters() if module is not None else source  # type: ignore[assignment]
        out = cls([], [], module, ddp)
        ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))  # DDP's own: rank-local, never reduced
        seen: set[int] = set()
        for k, item in enumerate(items):
            name, t = (f"param[{k}]", item) if isinstance(item, torch.Tensor) else _pair(item)
            if not isinstance(t, torch.Tensor):
                kind = type(item).__name__
                raise GradaggError(f"expected a module, tensors or (name, tensor) pairs; item {k} is {kind}")
            if id(t) in seen:
                continue
            if FSDP1_PREFIX in name.split("."):
                raise GradaggError(_fsdp1_text(f"parameter {name!r} belongs to an FSDP1 unit"))
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


def _refuse_fsdp1(module: torch.nn.Module) -> None:
    """FSDP1 is not supported yet: refused by name (every rank builds the same model, so every rank refuses).

    Its parameters are flat shards (or views of them) whose sizes differ per rank, and its reduce-scatter averages
    every microbatch: nothing gradagg's wrappers know. The class is looked up only where the user imported it.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp1 is None:
        return
    for name, m in module.named_modules():
        if isinstance(m, fsdp1):
            where = "the module given is FSDP1's FullyShardedDataParallel" if not name else (
                f"submodule {name!r} is FSDP1's FullyShardedDataParallel")
            raise GradaggError(_fsdp1_text(where))


def _fsdp1_text(where: str) -> str:
    return (
        f"{where}: FSDP1 is not supported yet; use FSDP2's fully_shard (torch.distributed.fsdp.fully_shard; "
        "Accelerate's FSDP plugin with fsdp_version=2, HF Trainer with fsdp_config={'fsdp_version': 2}, Lightning's "
        "ModelParallelStrategy), which gradagg keeps exact"
    )


def _pair(item: object) -> tuple[str, object]:
    if isinstance(item, tuple) and len(item) == 2:
        return str(item[0]), item[1]
    return "?", item


__all__ = ["ParamSource", "Params"]
