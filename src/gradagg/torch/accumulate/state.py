"""The accumulator's state, one object: what it accumulates, where it sends, its hooks, and the current window.

:class:`State` is what the public :class:`~gradagg.torch.MicrobatchAccumulator` holds and passes, explicitly,
to the functions of the other modules of this package (:mod:`.hooks`, :mod:`.opening`, :mod:`.finish`,
:mod:`.shards`): each reads and writes the state through its public fields, and none reaches into another
module's objects. The fixed part (parameters, group, FSDP and DDP sides, the layout) is set once by
:func:`build`; :attr:`State.window` is replaced by a fresh :class:`~.window.Window` after every window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from gradagg.errors import GradaggError
from gradagg.options import NonFinite
from gradagg.torch.accumulate import lifetime
from gradagg.torch.accumulate.ddp import DdpHold, ddp_group
from gradagg.torch.accumulate.flat import FlatLayout, ParamSpec, buffer_dtype
from gradagg.torch.accumulate.fsdp import FsdpParams, Mode, check_mode
from gradagg.torch.accumulate.ledger import Ledger, Span
from gradagg.torch.accumulate.meshes import check_fsdp_mesh, span_of
from gradagg.torch.accumulate.params import Params, ParamSource
from gradagg.torch.accumulate.window import Window
from gradagg.torch.buffers import ReusableBuffer
from gradagg.torch.collectives import (
    Group,
    check_launcher_world,
    check_member,
    device_for,
    get_rank,
    get_world_size,
)

_BYTES_PER_MB = 2**20
Pad = Callable[[], torch.Tensor] | Literal["replay"] | None  # see gradagg.torch.accumulate.padding


@dataclass
class State:
    """Everything one accumulator knows.

    Attributes:
        params: the accumulated parameters (under FSDP2 the sharded DTensors the optimizer holds).
        group: the process group (None: the default one, or no communication without one); under DDP, DDP's.
        nonfinite: ``"propagate"`` or ``"raise"``.
        bucket_mb: the size of a gradient bucket.
        fsdp: the FSDP2 side, if any parameter is a DTensor.
        ddp: the DDP side, if the source was a DDP module.
        window: the current window's counters and buffers.
        pools: reusable buffers: the window's input buffer; the reduce-scatter output.
        hooked: id(tensor) -> (tensor, hook handle), for every tensor with a gradient hook.
        extra_hooks: other handles to remove on close (the FSDP forward pre-hook, optimizer hooks).
        unsharded: FSDP2, while a window is open: parameter index -> its unsharded tensor.
        layout_checked: whether the ranks' parameter lists were compared (once per accumulator).
        closed: the hooks are gone; every call refuses.
        last: the ledger of the last finished window.
        next_last: set by ``microbatches()``: whether the next microbatch is the rank's last.
        sharded: indices of the FSDP2 (DTensor) parameters (set on construction).
        external: those FSDP2 reduces itself (``fsdp="shards"``), whose buffer slot stays empty.
        pad: the padding batch of the shards form (see :mod:`.padding`).
        padding: a padding microbatch is running (its gradients are dropped before FSDP or the buffer sees them).
        kept: the root module's last forward inputs ``(args, kwargs)``, replayed by ``pad="replay"``.
        padded_last: how many padding microbatches this rank ran in the last finished window.
        identity: ``(serial, fingerprint)``, the same on every rank for the same accumulator (see :func:`identify`);
            it travels with the window's counters so that ranks finishing different accumulators all refuse.
        site: where the user's code built it (``file:line``), to name it in messages.
        finished: windows finished so far (the same count on every rank), read by the guard.
        span: the group's global ranks, the mesh dims counted over (``mesh=``) and those FSDP2 reduces over.
    """

    params: Params
    group: Group
    nonfinite: NonFinite
    bucket_mb: float
    fsdp: FsdpParams | None
    ddp: DdpHold | None
    window: Window
    pools: tuple[ReusableBuffer, ReusableBuffer] = field(default_factory=lambda: (ReusableBuffer(), ReusableBuffer()))
    hooked: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)
    extra_hooks: list[Any] = field(default_factory=list)
    unsharded: dict[int, torch.Tensor] = field(default_factory=dict)
    layout_checked: bool = False
    closed: bool = False
    last: Ledger | None = None
    next_last: bool | None = None
    flat_layout: FlatLayout | None = None  # built on first use by layout()
    pad: Pad = "replay"
    padding: bool = False
    kept: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    padded_last: int = 0
    pad_failure: str | None = None  # a padding microbatch failed here; told at the next round (see .padding)
    identity: tuple[int, int] = (0, 0)
    finished: int = 0
    site: str = "?"
    superseded: str | None = None  # where the newer accumulator that closed this one was built (see .lifetime)
    span: Span = Span()
    terms: tuple[str, ...] = ()  # the loss terms counted as the window runs (see .terms_after); () without

    @property
    def names(self) -> list[str]:
        return self.params.names

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.params.tensors

    def __post_init__(self) -> None:
        # read in every hook call: computed once (a DTensor check per parameter otherwise)
        self.sharded: frozenset[int] = frozenset(self.params.sharded) if self.fsdp is not None else frozenset()
        self.external: frozenset[int] = self.sharded if self.every_microbatch() else frozenset()

    def label(self) -> str:
        """The accumulator as messages name it: ``accumulator #serial (built at site, over N parameters)``."""
        return f"accumulator #{self.identity[0]} (built at {self.site}, over {len(self.tensors)} parameters)"

    def every_microbatch(self) -> bool:
        """Whether FSDP2 reduces each microbatch itself (``fsdp="shards"``, formerly ``"every_microbatch"``)."""
        return self.fsdp is not None and self.fsdp.mode == "shards"

    def rounds(self) -> bool:
        """Whether the ranks agree on every microbatch and short ranks pad (the shards form, in a group)."""
        return self.every_microbatch() and get_world_size(self.group) > 1

    def takes(self, i: int) -> bool:
        """Whether parameter ``i``'s gradient goes into the accumulator's buffer (not reduced by FSDP itself)."""
        return i not in self.external

    def new_window(self) -> None:
        """Forget the window: counters to zero, buffers dropped (a second finish() cannot divide twice)."""
        self.window = Window(len(self.tensors))

    def layout(self) -> FlatLayout:
        """The flat buffer's layout: buckets and slots, the same on every rank (built once)."""
        if self.flat_layout is None:
            self.flat_layout = _build_layout(self)
        return self.flat_layout


def build(
    source: ParamSource,
    group: Group,
    nonfinite: NonFinite,
    fsdp: Mode,
    bucket_mb: float,
    pad: Pad = "replay",
    mesh: Any = None,
) -> State:
    """The state of a new accumulator (no hook yet: see :func:`gradagg.torch.accumulate.opening.install`).

    Raises:
        GradaggError: ``WORLD_SIZE`` > 1 in the environment but no process group; a ``group`` this process is not
            in; a DDP module whose ``process_group`` holds other ranks than ``group``; ``bucket_mb`` not a positive
            number; an invalid ``fsdp`` or ``pad``; DTensors without their module; a parameter on the meta device;
            an FSDP2 mesh over other ranks than the group; the errors of :func:`~.meshes.span_of`,
            :class:`~.ddp.DdpHold` and :class:`~.fsdp.FsdpParams`.
    """
    check_launcher_world("MicrobatchAccumulator")
    group, span = span_of(mesh, group)  # the data dims' group, when a mesh is given
    check_member(group, "MicrobatchAccumulator")
    if not isinstance(bucket_mb, int | float) or isinstance(bucket_mb, bool) or not bucket_mb > 0:
        raise GradaggError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
    params = Params.collect(source)
    if params.ddp is not None:
        group = ddp_group(params.ddp, group)  # DDP's own group, or a refusal of another one
        span = replace(span, ranks=tuple(sorted(lifetime.group_ranks(group))))
    meta = next((n for n, t in zip(params.names, params.tensors) if t.is_meta), None)
    if meta is not None:
        raise GradaggError(
            f"parameter {meta!r} is on the meta device: it holds no values, so no gradient of it can be summed; "
            "materialise the model first (model.to_empty(device=...) and initialise it), then build the accumulator"
        )
    if not (pad is None or pad == "replay" or callable(pad)):
        raise GradaggError(f"pad must be a function returning a loss, 'replay' or None, got {pad!r}")
    site = lifetime.user_site()
    lifetime.refuse_shared(params.names, params.tensors, site)
    fsdp_side, span = _fsdp_side(params, fsdp, group, span)
    # last: it changes the DDP module (no_sync, its buffer sync), which no later refusal may leave changed
    ddp = DdpHold(params.ddp, group, params.local) if params.ddp is not None else None
    state = State(params, group, nonfinite, float(bucket_mb), fsdp_side, ddp, Window(len(params.tensors)))
    state.pad, state.span = pad, span
    state.site, state.identity = site, lifetime.identify(params.names, params.tensors, lifetime.group_ranks(group))
    return state


def _fsdp_side(params: Params, mode: Mode, group: Group, span: Span) -> tuple[FsdpParams | None, Span]:
    sharded = params.sharded
    if not sharded:
        check_mode(mode)
        return None, span
    if params.module is None:
        raise GradaggError("DTensor parameters: pass the module fully_shard was applied to, not its parameters")
    names = [params.names[i] for i in sharded]
    fsdp_mesh = params.tensors[sharded[0]].device_mesh  # type: ignore[attr-defined]
    if get_world_size(group) > 1:
        check_fsdp_mesh(fsdp_mesh, span)  # before FsdpParams configures the modules
    side = FsdpParams(params.module, names, [params.tensors[i] for i in sharded], mode, get_world_size(group))
    dims = fsdp_mesh.mesh_dim_names or tuple(f"dim {i}" for i in range(fsdp_mesh.ndim))  # an unnamed mesh
    return side, replace(span, reduced_over=tuple(dims))


def _build_layout(state: State) -> FlatLayout:
    specs = []
    sharded = state.sharded
    for i, t in enumerate(state.tensors):
        kind = "reduce_scatter" if i in sharded else "all_reduce"
        if not state.takes(i):
            kind = "external"  # FSDP reduces it itself; only its participation is counted here
        specs.append(ParamSpec(tuple(t.shape), t.dtype, kind))  # type: ignore[arg-type]
    elem = torch.empty(0, dtype=buffer_dtype(specs)).element_size()
    fsdp = state.fsdp
    ways, shard_rank = (1, 0) if fsdp is None else (fsdp.ways, fsdp.shard_rank)
    return FlatLayout(
        specs,
        get_world_size(state.group),
        get_rank(state.group),
        device_for(state.group),
        int(state.bucket_mb * _BYTES_PER_MB / elem),
        ways,
        shard_rank,
    )


__all__ = ["State", "build"]
