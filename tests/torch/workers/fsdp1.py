"""Rank workers: FSDP1 (``FullyShardedDataParallel``) given to the accumulator (importable by the ranks)."""

from __future__ import annotations

import torch
from torch import nn

from gradagg.torch import MicrobatchAccumulator


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def fsdp1_world(how: str) -> str:
    """What ``MicrobatchAccumulator`` says of an FSDP1 model built ``how``: the error's type and text."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    cpu = torch.device("cpu")
    if how == "orig_params":
        model: nn.Module = FSDP(_model(), use_orig_params=True, device_id=cpu)
    elif how == "flat_params":
        model = FSDP(_model(), use_orig_params=False, device_id=cpu)
    elif how == "nested":
        model = FSDP(_model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True, device_id=cpu)
    elif how == "inner":  # an FSDP1 unit inside a plain module
        outer = _model()
        outer[0] = FSDP(outer[0], use_orig_params=True, device_id=cpu)
        model = outer
    elif how == "named":  # its (name, parameter) pairs: the names say FSDP1
        model = FSDP(_model(), use_orig_params=True, device_id=cpu)
    else:
        raise ValueError(how)
    try:
        MicrobatchAccumulator(list(model.named_parameters()) if how == "named" else model)
    except Exception as exc:  # the refusal under test
        return f"{type(exc).__name__}: {exc}"
    return "accepted"
