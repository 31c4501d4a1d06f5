"""One module per wrapper behind :class:`~gradagg.torch.accumulate.seam.Wrapper`, and :func:`chooser`, which picks one.

* :mod:`.plain`: a module or tensors (every other wrapper starts from it);
* :mod:`.ddp`: ``DistributedDataParallel``, held in ``no_sync()``;
* :mod:`.fsdp`: FSDP2's modules and shards (shared by both forms); :mod:`.fsdp_window`: ``fsdp="window"``;
  :mod:`.fsdp_shards`: ``fsdp="shards"``, with its rounds and padding (:mod:`.padding`, :mod:`.pad_run`);
* :mod:`.fsdp1`: FSDP1's ``FullyShardedDataParallel``, reduced through its communication hook, with the rounds and
  padding of :mod:`.padding`;
* :mod:`.deepspeed`: a DeepSpeed ZeRO engine, which reduces every gradient itself (chosen by
  :class:`gradagg.integrations.deepspeed.DeepSpeedAccumulator`, not by :func:`chooser`: only the engine tells).

:mod:`.unknown` watches the first forwards for a wrapper the accumulator was not given (started by the shell).

The accumulator's own modules never import these: the public shell passes :func:`chooser`'s result to
:func:`~gradagg.torch.accumulate.state.build`, and everything after calls the wrapper through the seam.
"""

from __future__ import annotations

from dataclasses import replace

from gradagg.errors import GradaggError
from gradagg.torch.accumulate import lifetime
from gradagg.torch.accumulate.ledger import Span
from gradagg.torch.accumulate.meshes import check_fsdp_mesh
from gradagg.torch.accumulate.params import Params
from gradagg.torch.accumulate.seam import Choice, Choose, Wrapper
from gradagg.torch.accumulate.wrappers import fsdp1
from gradagg.torch.accumulate.wrappers.ddp import Ddp, DdpHold, ddp_group
from gradagg.torch.accumulate.wrappers.fsdp import FsdpParams, Mode, check_mode
from gradagg.torch.accumulate.wrappers.fsdp_shards import FsdpShards
from gradagg.torch.accumulate.wrappers.fsdp_window import FsdpWindow
from gradagg.torch.accumulate.wrappers.padding import Pad
from gradagg.torch.accumulate.wrappers.plain import Plain
from gradagg.torch.collectives import Group, get_world_size


def chooser(fsdp: Mode, pad: Pad) -> Choose:
    """The function :func:`~gradagg.torch.accumulate.state.build` calls to choose the wrapper of the parameters.

    Args:
        fsdp: the FSDP2 form, ``"shards"`` or ``"window"`` (checked even without FSDP2).
        pad: the shards form's padding batch (checked even without FSDP2).

    Raises:
        GradaggError: an invalid ``fsdp`` or ``pad``.
    """
    mode = check_mode(fsdp)
    if not (pad is None or pad == "replay" or callable(pad)):
        raise GradaggError(f"pad must be a function returning a loss, 'replay' or None, got {pad!r}")

    def choose(params: Params, group: Group, span: Span) -> Choice:
        if params.ddp is not None:
            ddp, local = params.ddp, params.local
            group = ddp_group(ddp, group)  # DDP's own group, or a refusal of another one
            span = replace(span, ranks=tuple(sorted(lifetime.group_ranks(group))))
            return Choice(group, span, lambda: Ddp(DdpHold(ddp, group, local)))
        if params.fsdp1:
            return _fsdp1(params, mode, pad, group, span)
        if not params.sharded:
            return Choice(group, span, Plain)
        return _fsdp(params, mode, pad, group, span)

    return choose


def _fsdp(params: Params, mode: str, pad: Pad, group: Group, span: Span) -> Choice:
    sharded = params.sharded
    module = params.module
    if module is None:
        raise GradaggError("DTensor parameters: pass the module fully_shard was applied to, not its parameters")
    mesh = params.tensors[sharded[0]].device_mesh  # type: ignore[attr-defined]
    dims = mesh.mesh_dim_names or tuple(f"dim {i}" for i in range(mesh.ndim))  # an unnamed mesh
    world = get_world_size(group)

    def make() -> Wrapper:
        if world > 1:
            check_fsdp_mesh(mesh, span)  # before FsdpParams configures the modules
        names = [params.names[i] for i in sharded]
        side = FsdpParams(module, names, [params.tensors[i] for i in sharded], mode, world)  # type: ignore[arg-type]
        if mode == "window":
            return FsdpWindow(side, frozenset(sharded))
        return FsdpShards(side, frozenset(sharded), pad, group)

    return Choice(group, replace(span, reduced_over=tuple(dims)), make)


def _fsdp1(params: Params, mode: str, pad: Pad, group: Group, span: Span) -> Choice:
    """FSDP1's wrapper, over FSDP1's own process group (a ``group=`` of other ranks is refused); under the hybrid
    strategies over ``group`` (the whole data-parallel world FSDP1 averages over)."""
    roots = params.fsdp1
    own = getattr(roots[0], "process_group", None)
    # the hybrid strategies (and NO_SHARD on one rank): FSDP1 averages over the whole world itself
    hybrid = params.module is not None and fsdp1.own_average(params.module)
    if own is not None and group is None and not hybrid:
        group = own
    elif own is not None and not hybrid and lifetime.group_ranks(own) != lifetime.group_ranks(group):
        raise GradaggError(f"FSDP1 shards over ranks {list(lifetime.group_ranks(own))} but the accumulator was given "
                           f"group ranks {list(lifetime.group_ranks(group))}: pass group=None (FSDP1's own group)")
    module = params.module
    why = None if module is None else fsdp1.refusal(module, mode, get_world_size(group))
    held = {id(p) for root in roots for p in root.parameters()}
    outside = [n for n, t in zip(params.names, params.tensors) if id(t) not in held]
    if why is None and outside:  # FSDP1 reduces only what its units hold: these would stay rank-local
        why = (f"parameter {outside[0]!r} is in no FSDP1 unit ({len(outside)} such): FSDP1 would not reduce it, so "
               "each rank would keep its own gradient; wrap the root module in FSDP1 too (an auto-wrap policy for the "
               "blocks and FullyShardedDataParallel(model) around them)")
    if why is not None:
        raise GradaggError(why)
    span = replace(span, ranks=tuple(sorted(lifetime.group_ranks(group))))
    return Choice(group, span, lambda: fsdp1.Fsdp1Shards(roots, len(params.tensors), pad, group, hybrid))


__all__ = ["Choice", "Choose", "chooser"]
