"""FSDP2 (``fully_shard``) and HSDP under the accumulator, through FSDP's public ``FSDPModule`` methods only.

Two ways to accumulate (``MicrobatchAccumulator(model, fsdp=...)``):

* ``"window"`` (default): any number of microbatches per rank, zero included. At the window's start every
  rank unshards every FSDP module (``FSDPModule.unshard``, in module order: the same all-gathers on every
  rank, the one collective FSDP needs); parameters stay unsharded over the window
  (``set_reshard_after_forward(False)``, ``set_reshard_after_backward(False)``) and FSDP never reduces
  (``set_requires_gradient_sync(False)``), so forwards and backwards send nothing, however many each
  rank runs. Post-accumulate-grad hooks on the *unsharded* parameters (public
  ``Tensor.register_post_accumulate_grad_hook``) count participation and move each microbatch's gradient
  into the accumulator's reduce-scatter buffer. ``finish()`` reduce-scatters it (on HSDP then all-reduces
  the shard over the replicas: the cross-replica step happens once, at the window's end), divides by the
  counted divisor, sets each sharded parameter's ``.grad`` to a ``DTensor`` and reshards. Memory: the
  unsharded parameters and one unsharded gradient buffer for the whole window.
* ``"every_microbatch"``: FSDP's own reduce-scatter after every microbatch, forced to a plain sum
  (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``: gloo rejects
  ``PREMUL_SUM``) with zeros for parameters a microbatch did not use
  (``set_reduce_scatter_unused_params(True)``); ``finish()`` divides the accumulated sharded gradients.
  Only sharded gradients are held, but FSDP's collectives then run once per microbatch, so **every rank
  must run the same number of microbatches**: pad short ranks with ``weight=0`` microbatches.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from gradagg.errors import GradaggError

Mode = Literal["window", "every_microbatch"]
MODES: tuple[str, ...] = ("window", "every_microbatch")


class FsdpParams:
    """The FSDP2 side of an accumulator: the FSDP modules, the mesh, and the sharded parameters.

    Args:
        root: the module ``fully_shard`` was applied to (and to its blocks).
        names: the sharded parameters' names (``root.named_parameters()`` names).
        params: the sharded parameters, DTensors, in the same order.
        mode: see the module docstring.
        world: ranks in the accumulator's group; the mesh must span them all.

    Raises:
        GradaggError: no FSDP module under ``root``; parameters on different meshes or placements other
            than ``(Shard(0),)`` (FSDP) or ``(Replicate(), Shard(0))`` (HSDP); a mesh that does not span the
            group; a local shard that is not the ``torch.chunk`` rows of dim 0.
    """

    def __init__(self, root: nn.Module, names: list[str], params: list[torch.Tensor], mode: Mode, world: int) -> None:
        from torch.distributed.fsdp import FSDPModule

        if mode not in MODES:
            raise GradaggError(f"fsdp must be 'window' or 'every_microbatch', got {mode!r}")
        self.root, self.names, self.params, self.mode = root, names, params, mode
        self.modules: list[Any] = [m for m in root.modules() if isinstance(m, FSDPModule)]
        if not self.modules:
            raise GradaggError(
                f"parameter {names[0]!r} is a DTensor but no module under the one given was passed to fully_shard; "
                "pass the module fully_shard was applied to"
            )
        self.mesh: Any = params[0].device_mesh  # type: ignore[attr-defined]
        self._check_placements()
        self.ways = self.mesh.size(self.mesh.ndim - 1)
        self.shard_rank = self.mesh.get_local_rank(self.mesh.ndim - 1)
        self.shard_group = self.mesh.get_group(self.mesh.ndim - 1)
        self.replicate_group = self.mesh.get_group(0) if self.mesh.ndim == 2 else None
        if self.mesh.size() != world:
            raise GradaggError(f"the FSDP mesh spans {self.mesh.size()} ranks, the accumulator's group {world}")
        self._check_local_shapes()
        self._configure()

    def _check_placements(self) -> None:
        from torch.distributed.tensor import Replicate, Shard

        allowed = ((Shard(0),), (Replicate(), Shard(0)))
        for name, p in zip(self.names, self.params):
            placements = tuple(p.placements)  # type: ignore[attr-defined]
            if p.device_mesh != self.mesh:  # type: ignore[attr-defined]
                raise GradaggError(f"parameter {name!r} lives on another device mesh than {self.names[0]!r}")
            if placements not in allowed:
                raise GradaggError(
                    f"parameter {name!r} has placements {placements}; supported: (Shard(0),) for FSDP and "
                    "(Replicate(), Shard(0)) for HSDP"
                )

    def _check_local_shapes(self) -> None:
        for name, p in zip(self.names, self.params):
            rows = p.shape[0] if p.dim() else 1
            chunk = -(-rows // self.ways)
            want = max(0, min(rows, (self.shard_rank + 1) * chunk) - self.shard_rank * chunk)
            local = tuple(p.to_local().shape)  # type: ignore[attr-defined]
            if local[:1] != (want,) or local[1:] != tuple(p.shape[1:]):
                raise GradaggError(
                    f"parameter {name!r} of shape {tuple(p.shape)} has the local shard {local} on shard rank "
                    f"{self.shard_rank} of {self.ways}, expected ({want}, ...) (torch.chunk rows of dim 0)"
                )

    def _configure(self) -> None:
        for m in self.modules:
            if self.mode == "window":
                m.set_requires_gradient_sync(False, recurse=False)
                m.set_reshard_after_forward(False, recurse=False)
                m.set_reshard_after_backward(False, recurse=False)
            else:
                m.set_requires_gradient_sync(True, recurse=False)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
                m.set_reduce_scatter_unused_params(True, recurse=False)

    def unshard(self) -> dict[str, torch.Tensor]:
        """Unshard every FSDP module (the same all-gathers, in module order, on every rank).

        Returns:
            name -> the unsharded parameter now registered under that name.

        Raises:
            GradaggError: a parameter is still a DTensor after unsharding.
        """
        for m in self.modules:
            m.unshard()
        now = dict(self.root.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for name in self.names:
            t = now.get(name)
            if t is None or _is_dtensor(t):
                raise GradaggError(f"parameter {name!r} is not unsharded after FSDPModule.unshard()")
            out[name] = t
        return out

    def reshard(self) -> None:
        """Reshard every FSDP module (window mode: the unsharded parameters are freed)."""
        if self.mode == "window":
            for m in self.modules:
                m.reshard()

    def set_all_reduce(self, enabled: bool) -> None:
        """every_microbatch on HSDP: whether FSDP's backward all-reduces over the replicas this microbatch."""
        if self.mode == "every_microbatch" and self.replicate_group is not None:
            for m in self.modules:
                m.set_requires_all_reduce(enabled, recurse=False)

    @staticmethod
    def sharded_grad(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """A DTensor gradient for the sharded parameter ``p`` from this rank's rows of it."""
        from torch.distributed.tensor import DTensor

        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        return DTensor.from_local(local.to(p.dtype), mesh, placements, shape=p.shape, stride=p.stride())

    def restore(self) -> None:
        """Give FSDP its defaults back: sync every backward, reshard after backward (after forward: not the root)."""
        for m in self.modules:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
            m.set_reshard_after_forward(m is not self.root, recurse=False)
            m.set_requires_all_reduce(True, recurse=False)


def _is_dtensor(t: torch.Tensor) -> bool:
    import sys

    mod = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor can exist
    return mod is not None and isinstance(t, mod.DTensor)


is_dtensor = _is_dtensor

__all__ = ["MODES", "FsdpParams", "Mode", "is_dtensor"]
