"""FSDP2 (``fully_shard``) and HSDP under the accumulator, through FSDP's public ``FSDPModule`` methods only.

Two ways to accumulate (``MicrobatchAccumulator(model, fsdp=...)``):

* ``"shards"`` (default; ``"every_microbatch"`` is its former name, still accepted): only sharded gradients
  are held, FSDP reduce-scattering each microbatch (below), with any number of microbatches per rank, zero
  included: the ranks agree on each microbatch and a rank that ran out pads (see :mod:`.padding`).
* ``"window"``: any number of microbatches per rank, zero included, no padding. At the window's start every
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
How ``"shards"`` reduces: FSDP's own reduce-scatter after every microbatch, forced to a plain sum
  (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``: gloo rejects
  ``PREMUL_SUM``) with zeros for parameters a microbatch did not use
  (``set_reduce_scatter_unused_params(True)``). FSDP hands each microbatch's reduced shard to a
  post-accumulate-grad hook on the sharded parameter (it calls those after every reduce); the accumulator
  sums the shards in float32 at least (FSDP would add them into ``.grad`` in the parameter's dtype, bf16
  for bf16 parameters) and ``finish()`` divides them. Participation is counted on the unsharded parameters,
  hooked when a window opens: the modules are unsharded one at a time there, each resharded before the
  next. Only sharded gradients are held, but FSDP's
  collectives then run once per microbatch on every rank: a rank that ran out runs a padding microbatch
  (:mod:`.padding`), which adds exactly zero and counts nowhere.

Mixed precision (``MixedPrecisionPolicy``): forwards and backwards run as FSDP configures them; every sum
over microbatches is in float32 at least (window: gradagg's buffer, reduce-scattered in float32 whatever
``reduce_dtype`` says; every_microbatch: FSDP reduces each microbatch in its ``reduce_dtype``, gradagg sums
them), and ``.grad`` is handed out in the sharded parameter's own dtype. Parameters that no FSDP unit
holds (plain tensors: blocks sharded but not the root, ``ignored_params``, a module attached after
``fully_shard``) are reduced as replicas over the whole group, divided by the same D. A DTensor that no
``fully_shard`` manages is refused when the first window opens (only then are FSDP's parameters
unsharded, which is how a public API tells them apart).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import nn

from gradagg.errors import GradaggError, PrecisionWarning

Mode = Literal["shards", "window", "every_microbatch"]
MODES: tuple[str, ...] = ("shards", "window", "every_microbatch")


def check_mode(mode: object) -> str:
    """The FSDP2 form named by ``mode``: ``"shards"`` or ``"window"`` (``"every_microbatch"`` is ``"shards"``).

    Raises:
        GradaggError: any other value.

    >>> check_mode("every_microbatch")
    'shards'
    """
    if mode not in MODES:
        raise GradaggError(f"fsdp must be 'shards' (the default), 'window' or 'every_microbatch', got {mode!r}")
    return "window" if mode == "window" else "shards"


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

        self.root, self.names, self.params, self.mode = root, names, params, check_mode(mode)
        self.modules: list[Any] = [m for m in root.modules() if isinstance(m, FSDPModule)]
        if not self.modules:
            raise GradaggError(
                f"parameter {names[0]!r} is a DTensor ({_where(params[0])}) but no module under the one given was "
                "passed to fully_shard: gradagg reduces DTensor parameters made by fully_shard (FSDP2, HSDP) only, "
                "not tensor-parallel or distribute_tensor ones; pass the module fully_shard was applied to"
            )
        self.low_precision = False  # whether FSDP computes in a dtype below float32 (known once unsharded)
        self.mesh: Any = params[0].device_mesh  # type: ignore[attr-defined]
        self._check_placements()
        self.ways = self.mesh.size(self.mesh.ndim - 1)
        self.shard_rank = self.mesh.get_local_rank(self.mesh.ndim - 1)
        self.shard_group = self.mesh.get_group(self.mesh.ndim - 1)
        self.replicate_group = self.mesh.get_group(0) if self.mesh.ndim == 2 else None
        if self.mesh.size() != world:
            raise GradaggError(f"the FSDP mesh spans {self.mesh.size()} ranks, the accumulator's group {world}")
        self._check_local_shapes()
        self._holders = self._find_holders()
        self._configure()
        if self.mode == "shards" and world > 1:
            warn_low_reduce(self.modules, world)

    def _check_placements(self) -> None:
        from torch.distributed.tensor import Replicate, Shard

        allowed = ((Shard(0),), (Replicate(), Shard(0)))
        for name, p in zip(self.names, self.params):
            placements = tuple(p.placements)  # type: ignore[attr-defined]
            if placements not in allowed:
                raise GradaggError(
                    f"parameter {name!r} has placements {placements} on {p.device_mesh}; supported: (Shard(0),) "  # type: ignore[attr-defined]
                    "for FSDP and (Replicate(), Shard(0)) for HSDP, on one mesh (not tensor parallel, not 3-D meshes)"
                )
            if p.device_mesh != self.mesh:  # type: ignore[attr-defined]
                raise GradaggError(
                    f"parameter {name!r} ({_where(p)}) lives on another device mesh than {self.names[0]!r} "
                    f"({_where(self.params[0])}); every FSDP parameter must share one mesh"
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

    def _find_holders(self) -> list[list[tuple[int, nn.Module, str]]]:
        """Per FSDP module, the sharded parameters it manages: (index, the module that holds it, its attribute).

        Found by identity among each submodule's own parameters (``named_parameters(recurse=False)``) down to the
        nested FSDP modules, never by dotted name: wrappers rename parameters (``CheckpointWrapper.named_parameters``,
        torchtitan's activation checkpointing, drops ``_checkpoint_wrapped_module.``, which the root's names keep),
        while the holder's attribute is where FSDP swaps the sharded and unsharded tensors.
        """
        from torch.distributed.fsdp import FSDPModule

        index = {id(p): j for j, p in enumerate(self.params)}
        out: list[list[tuple[int, nn.Module, str]]] = []
        for m in self.modules:
            held: list[tuple[int, nn.Module, str]] = []
            stack, seen = [m], set()
            while stack:
                sub = stack.pop()
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                held += [(index[id(p)], sub, a) for a, p in sub.named_parameters(recurse=False) if id(p) in index]
                stack += [c for c in sub.children() if not isinstance(c, FSDPModule)]
            out.append(held)
        return out

    def unshard(self) -> dict[str, torch.Tensor]:
        """Unshard every FSDP module (the same all-gathers, in module order, on every rank).

        In window form they stay unsharded over the window. In shards form each module is resharded
        as soon as its unsharded parameters are known (FSDP keeps those tensor objects across its own
        unshard/reshard, so hooks on them keep firing): one module is unsharded at a time, never the model.

        Returns:
            name -> the unsharded parameter now registered under that name.

        Raises:
            GradaggError: a parameter is still a DTensor after unsharding.
        """
        now: dict[int, torch.Tensor] = {}
        shards = {id(p) for p in self.params}
        for m, held in zip(self.modules, self._holders):
            m.unshard()
            for j, holder, attr in held:
                # the tensor FSDP registers there now: an unsharded parameter, another object than the shard.
                # Told apart by identity, not by type: under torchtitan's full_dtensor backend (fully_shard with
                # dp_mesh_dims) the unsharded parameters are DTensors too, Replicate() on the data-parallel dims
                t = getattr(holder, attr)
                if id(t) not in shards:
                    now.setdefault(j, t)
            if self.mode == "shards":
                m.reshard()
        out: dict[str, torch.Tensor] = {}
        for j, (name, p) in enumerate(zip(self.names, self.params)):
            t = now.get(j)
            if t is None:
                raise GradaggError(
                    f"parameter {name!r} ({_where(p)}) is still a DTensor after every FSDP module unsharded: no "
                    "fully_shard manages it (registered after fully_shard, or made by distribute_tensor or tensor "
                    "parallel), so nothing would gather or reduce it; gradagg refuses it"
                )
            out[name] = t
        self.low_precision = any(low_precision(t.dtype) for t in out.values())
        return out

    def reshard(self) -> None:
        """Reshard every FSDP module (window mode: the unsharded parameters are freed)."""
        if self.mode == "window":
            for m in self.modules:
                m.reshard()

    def set_all_reduce(self, enabled: bool) -> None:
        """every_microbatch on HSDP: whether FSDP's backward all-reduces over the replicas this microbatch.

        Never deferred when FSDP computes in bf16 or fp16: FSDP would add the deferred microbatches' shards in
        its reduce dtype, which may be that same low precision (``reduce_dtype=None``; no public API tells), and
        256 + 1 rounds to 256 in bf16. All-reduced every microbatch, each lands in the float32 sum of
        :func:`gradagg.torch.accumulate.shards.on_shard`.
        """
        if self.mode == "shards" and self.replicate_group is not None:
            for m in self.modules:
                m.set_requires_all_reduce(enabled or self.low_precision, recurse=False)

    @staticmethod
    def sharded_grad(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """A DTensor gradient for the sharded parameter ``p`` from this rank's rows of it."""
        from torch.distributed.tensor import DTensor

        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        device = p.to_local().device  # type: ignore[attr-defined]  # the CPU under CPUOffloadPolicy, as FSDP's own
        local = local.to(device=device, dtype=p.dtype)
        return DTensor.from_local(local, mesh, placements, shape=p.shape, stride=p.stride())

    def restore(self) -> None:
        """Give FSDP its defaults back: sync every backward, reshard after backward (after forward: not the root)."""
        for m in self.modules:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
            m.set_reshard_after_forward(m is not self.root, recurse=False)
            m.set_requires_all_reduce(True, recurse=False)


def reduce_dtype(modules: list[Any]) -> torch.dtype | None:
    """The dtype FSDP2 reduces gradients in, where a ``MixedPrecisionPolicy`` lowers it: its ``reduce_dtype``, else
    its ``param_dtype`` (gradients are computed in it); None where no policy lowers it, or where it cannot be read.

    No public API tells the policy back: read through ``FSDPModule._get_fsdp_state()._mp_policy`` (private, torch
    2.6 to 2.13). Without it (a later torch), None: no warning, and the sums are what they are.
    """
    for m in modules:
        policy = getattr(getattr(m, "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
        dtype = getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None)
        if isinstance(dtype, torch.dtype) and low_precision(dtype):
            return dtype
    return None


def warn_low_reduce(modules: list[Any], world: int) -> None:
    """The shards form under a policy that reduces in bf16 or fp16: FSDP sums each microbatch over the ranks in that
    dtype before gradagg's float32 sum over microbatches, so a window is exact only within that dtype's round-off,
    growing with the ranks (measured within (world - 1) eps/2 on 2 and 3 ranks). Said once, at construction."""
    dtype = reduce_dtype(modules)
    if dtype is None:
        return
    eps = torch.finfo(dtype).eps
    warnings.warn(
        f"fsdp='shards' with a MixedPrecisionPolicy that reduces in {dtype}: FSDP sums each microbatch's gradient "
        f"over the {world} ranks in {dtype} before gradagg sums the microbatches in float32, so the window is exact "
        f"only within about ({world} - 1) x {eps / 2:.2g} relative; reduce_dtype=torch.float32, or fsdp='window' "
        "(which reduces in float32 whatever the policy), keeps float32's round-off",
        PrecisionWarning, stacklevel=6)


def low_precision(dtype: torch.dtype) -> bool:
    """Whether sums in ``dtype`` lose what float32 keeps (bf16, fp16: 256 + 1 is 256 in bf16).

    >>> low_precision(torch.bfloat16), low_precision(torch.float32)
    (True, False)
    """
    return dtype.is_floating_point and torch.finfo(dtype).eps > torch.finfo(torch.float32).eps


def _where(p: torch.Tensor) -> str:
    """A DTensor's placements and mesh, for messages."""
    return f"placements {tuple(p.placements)} on {p.device_mesh}"  # type: ignore[attr-defined]

__all__ = ["MODES", "FsdpParams", "Mode", "check_mode", "low_precision", "reduce_dtype", "warn_low_reduce"]
