"""``--wrap``: gradagg's model copy as a plain module, under ``DistributedDataParallel``, or sharded by FSDP2.

Whatever the wrapper, the demo reads the model the same way: the full values of its parameters and of
their gradients under the plain module's names (DDP's ``module.`` prefix dropped; FSDP2's DTensors
gathered with ``full_tensor()``, a collective that every rank runs in the same order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gradagg.demo.models import Params


def wrap(module: nn.Module, how: str, units: list[nn.Module]) -> nn.Module:
    """Wrap ``module`` for training across the default process group.

    Args:
        module: the plain model, the same values on every rank.
        how: ``"none"``, ``"ddp"`` or ``"fsdp"`` (``fully_shard`` on each of ``units``, then on the root,
            over a 1-D CPU mesh of every rank).
        units: the submodules FSDP2 shards on their own.

    Returns:
        The model to train (the same object for ``"none"`` and ``"fsdp"``).

    >>> lin = torch.nn.Linear(1, 1)
    >>> wrap(lin, "none", []) is lin
    True
    """
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module)  # no buffers in the demo's models: nothing to broadcast
    if how == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(module, mesh=mesh)
    return module


def full_values(model: nn.Module) -> Params:
    """The full value of every parameter, detached, under the plain module's names.

    Args:
        model: a model returned by :func:`wrap`.

    Returns:
        name -> a tensor that shares nothing with autograd.

    >>> full_values(torch.nn.Linear(2, 1))["weight"].shape
    torch.Size([1, 2])
    """
    return {_plain(name): _full(p).detach() for name, p in model.named_parameters()}


def full_grads(model: nn.Module) -> Params:
    """The full gradient of every parameter (zeros where ``.grad`` is None), under the plain module's names.

    Args:
        model: a model returned by :func:`wrap`.

    Returns:
        name -> gradient.

    >>> full_grads(torch.nn.Linear(2, 1))["bias"]
    tensor([0.])
    """
    return {_plain(name): torch.zeros_like(_full(p)) if p.grad is None else _full(p.grad)
            for name, p in model.named_parameters()}


def _plain(name: str) -> str:
    return name.removeprefix("module.")  # DistributedDataParallel's prefix


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor (FSDP2): gather the shards
    return full() if callable(full) else t  # type: ignore[no-any-return]
