"""A wrapper the accumulator was not given: refused at the first forward through it, on every rank that runs one.

In :mod:`.wrappers` since it asks which wrapper a module is; the public shell starts it (:func:`watch`).

The accumulator adapts to the wrapper it is given (DDP, FSDP1, FSDP2, DeepSpeed: :mod:`.wrappers`). A model wrapped
*after* the accumulator was built, or an accumulator given the module *inside* a wrapper the loop trains through,
leaves the wrapper reducing every backward on its own: DDP and FSDP1 average each microbatch over the ranks (and
with uneven microbatch counts the ranks' collectives no longer pair: gloo aborts the process), ``fully_shard`` has
replaced the parameters by DTensors the accumulator does not hold, DeepSpeed's engine reduces by its own count.

So from construction until its first microbatch has run, the accumulator watches every module's forward (torch's
public global ``register_module_forward_pre_hook``; removed after, so that later forwards pay nothing): a forward
through a DDP, FSDP1, FSDP2 or DeepSpeed module that holds the accumulated parameters, and that the accumulator does
not know, raises :class:`~gradagg.errors.GradaggError` before the wrapper's first collective, naming the wrapper and
the fix (give the accumulator the wrapped module). Every rank that runs a forward raises there; a rank that runs
none meets the others' absence in ``finish()``'s collective (``CollectiveError`` within the collective timeout).
A model wrapped after the first microbatch is not seen (the parameters' identities are then compared at each
window's opening, which catches ``fully_shard`` and FSDP1 with flat parameters, not DDP).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradagg.errors import GradaggError
from gradagg.torch.accumulate.params import fsdp1_class
from gradagg.torch.accumulate.state import State


def kind_of(module: nn.Module) -> str | None:
    """Which wrapper ``module`` is: ``"DDP"``, ``"FSDP1"``, ``"FSDP2"``, ``"DeepSpeed"``, or None (classes looked up
    only where the user imported them).

    >>> kind_of(nn.Linear(1, 1)) is None
    True
    """
    if isinstance(module, DistributedDataParallel):
        return "DDP"
    fsdp1 = fsdp1_class()
    if fsdp1 is not None and isinstance(module, fsdp1):
        return "FSDP1"
    fsdp2 = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp2 is not None and isinstance(module, fsdp2):
        return "FSDP2"
    engine = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
    if engine is not None and isinstance(module, engine):
        return "DeepSpeed"
    return None


_WHY = {
    "DDP": "DDP all-reduces every backward itself, averaging over the ranks (and with uneven microbatch counts its "
           "collectives no longer pair)",
    "FSDP1": "FSDP1 reduce-scatters every backward itself, averaging over the ranks (and with uneven microbatch "
             "counts its collectives no longer pair)",
    "FSDP2": "fully_shard replaced the parameters by DTensors the accumulator does not hold, and reduces every "
             "backward itself",
    "DeepSpeed": "DeepSpeed's engine reduces every gradient itself, by its own count",
}
_FIX = {
    "DDP": "MicrobatchAccumulator(ddp_model)",
    "FSDP1": "MicrobatchAccumulator(fsdp_model)",
    "FSDP2": "MicrobatchAccumulator(model) after fully_shard(model)",
    "DeepSpeed": "gradagg.integrations.deepspeed.exact(engine)",
}


def unknown(state: State, module: nn.Module) -> str | None:
    """Why a forward through ``module`` escapes the accumulator (see the module docstring), or None."""
    kind = kind_of(module)
    if kind is None or not _holds(state, module):
        return None
    params = state.params
    known = {
        "DDP": module is params.ddp,
        "FSDP1": bool(params.fsdp1),
        "FSDP2": bool(state.sharded),
        "DeepSpeed": state.wrapper.name == "deepspeed",
    }[kind]
    if known:
        return None
    return (f"rank {state.rank}: the forward runs through {type(module).__name__} ({kind}), which holds the "
            f"accumulated parameters but was not given to {state.label()} (the model was wrapped after it was built, "
            f"or it was given the module inside): {_WHY[kind]}; give the accumulator the wrapped module: "
            f"{_FIX[kind]}")


def _holds(state: State, module: nn.Module) -> bool:
    mine = state.params.module
    if mine is not None:
        return any(m is mine for m in module.modules())
    ids = {id(t) for t in state.tensors}
    return any(id(p) in ids for p in module.parameters())


def watch(state: State) -> None:
    """Watch every forward from now until the accumulator's first microbatch has run (see the module docstring)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    handle: Any = None

    def check(module: nn.Module, _args: object) -> None:
        if state.closed or state.finished or state.window.m:
            handle.remove()  # past the first microbatch (or closed): later forwards pay nothing
            return
        if torch.is_grad_enabled():
            why = unknown(state, module)
            if why is not None:
                raise GradaggError(why)

    handle = register_module_forward_pre_hook(check)
    state.extra_hooks.append(handle)


__all__ = ["kind_of", "unknown", "watch"]
