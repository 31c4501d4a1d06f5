"""The accumulator's state, one object: what it accumulates, where it sends, its hooks, and the current window.

:class:`State` is what the public :class:`~gradagg.torch.MicrobatchAccumulator` holds and passes, explicitly,
to the functions of the other modules of this package (:mod:`.hooks`, :mod:`.opening`, :mod:`.finish`):
each reads and writes the state through its public fields, and none reaches into another module's objects.
What differs between plain modules, DDP, FSDP2 and DeepSpeed is the :attr:`State.wrapper`'s (see :mod:`.seam`);
the state holds only what every wrapper shares. The fixed part (parameters, group, wrapper, the layout) is set once by
:func:`build`; :attr:`State.window` is replaced by a fresh :class:`~.window.Window` after every window (:mod:`.finish`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from gradagg.errors import GradaggError
from gradagg.options import NonFinite
from gradagg.torch.accumulate import lifetime
from gradagg.torch.accumulate.flat import FlatLayout, ParamSpec, buffer_dtype
from gradagg.torch.accumulate.ledger import Ledger, Span
from gradagg.torch.accumulate.meshes import span_of
from gradagg.torch.accumulate.params import Params, ParamSource
from gradagg.torch.accumulate.seam import Choose, Wrapper
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


@dataclass
class State:
    """Everything one accumulator knows.

    Attributes:
        params: the accumulated parameters (under FSDP2 the sharded DTensors the optimizer holds).
        group: the process group (None: the default one, or no communication without one); under DDP, DDP's.
        nonfinite: ``"propagate"`` or ``"raise"``.
        bucket_mb: the size of a gradient bucket.
        wrapper: what differs for the module's wrapper (plain, DDP, FSDP2's two forms, DeepSpeed): see :mod:`.seam`.
        window: the current window's counters and buffers.
        world, rank, device: the group's size, this process's rank in it (1 and 0 with no process group), and the
            device its collectives run on.
        pools: reusable buffers: the window's input buffer; the reduce-scatter output.
        hooked: id(tensor) -> (tensor, hook handle), for every tensor with a gradient hook.
        extra_hooks: other handles to remove on close (forward pre-hooks, optimizer hooks).
        layout_checked: whether the ranks' parameter lists were compared (once per accumulator).
        closed: the hooks are gone; every call refuses.
        last: the ledger of the last finished window.
        sharded: the wrapper's parameters held as shards (read in every hook call: a set, computed once).
        external: those the wrapper reduces itself, whose buffer slot stays empty.
        taken: ``(index, parameter)`` of the others, whose own ``.grad`` the hooks take into the buffer.
        padded_last: how many padding microbatches this rank ran in the last finished window (FSDP2's shards
            form pads a rank that ran out; 0 elsewhere).
        identity: ``(serial, fingerprint)``, the same on every rank for the same accumulator (see :func:`identify`);
            it travels with the window's counters so that ranks finishing different accumulators all refuse.
        site: where the user's code built it (``file:line``), to name it in messages.
        finished: windows finished so far (the same count on every rank), read by the guard.
        handed: index -> the gradient the last ``finish()`` handed out (a weak reference) and its version, to name a
            refusal (see :func:`.stale.cause`).
        span: the group's global ranks, the mesh dims counted over (``mesh=``) and those FSDP2 reduces over.
    """

    params: Params
    group: Group
    nonfinite: NonFinite
    bucket_mb: float
    wrapper: Wrapper
    window: Window
    world: int = 1
    rank: int = 0
    device: torch.device = torch.device("cpu")
    pools: tuple[ReusableBuffer, ReusableBuffer] = field(default_factory=lambda: (ReusableBuffer(), ReusableBuffer()))
    hooked: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)
    extra_hooks: list[Any] = field(default_factory=list)
    layout_checked: bool = False
    closed: bool = False
    last: Ledger | None = None
    flat_layout: FlatLayout | None = None  # built on first use by layout()
    padded_last: int = 0
    identity: tuple[int, int] = (0, 0)
    finished: int = 0
    handed: dict[int, tuple[weakref.ref[torch.Tensor], int | None]] = field(default_factory=dict)
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
        self.sharded: frozenset[int] = self.wrapper.sharded
        self.external: frozenset[int] = self.wrapper.external
        # the parameters whose own .grad the hooks take, read before and after every microbatch: listed once
        self.taken: list[tuple[int, torch.Tensor]] = [
            (i, t) for i, t in enumerate(self.tensors) if i not in self.sharded and i not in self.external
        ]

    def label(self) -> str:
        """The accumulator as messages name it: ``accumulator #serial (built at site, over N parameters)``."""
        return f"accumulator #{self.identity[0]} (built at {self.site}, over {len(self.tensors)} parameters)"

    def takes(self, i: int) -> bool:
        """Whether parameter ``i``'s gradient goes into the accumulator's buffer (not reduced by the wrapper)."""
        return i not in self.external

    def layout(self) -> FlatLayout:
        """The flat buffer's layout: buckets and slots, the same on every rank (built once)."""
        if self.flat_layout is None:
            self.flat_layout = _build_layout(self)
        return self.flat_layout


def build(
    source: ParamSource,
    group: Group,
    nonfinite: NonFinite,
    bucket_mb: float,
    mesh: Any,
    choose: Choose,
) -> State:
    """The state of a new accumulator (no hook yet: see :func:`gradagg.torch.accumulate.opening.install`).

    Args:
        choose: picks the parameters' wrapper (:func:`gradagg.torch.accumulate.wrappers.chooser`).

    Raises:
        GradaggError: ``WORLD_SIZE`` > 1 in the environment but no process group; a ``group`` this process is not
            in; ``bucket_mb`` not a positive number; a parameter on the meta device; a parameter another live
            accumulator holds; the errors of :func:`~.meshes.span_of` and of the wrapper chosen (a DDP module over
            other ranks than ``group``, FSDP2 layouts, ...).
    """
    check_launcher_world("MicrobatchAccumulator")
    group, span = span_of(mesh, group)  # the data dims' group, when a mesh is given
    check_member(group, "MicrobatchAccumulator")
    if not isinstance(bucket_mb, int | float) or isinstance(bucket_mb, bool) or not bucket_mb > 0:
        raise GradaggError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
    params = Params.collect(source)
    choice = choose(params, group, span)  # refusals only: nothing of the model is changed yet
    meta = next((n for n, t in zip(params.names, params.tensors) if t.is_meta), None)
    if meta is not None:
        raise GradaggError(
            f"parameter {meta!r} is on the meta device: it holds no values, so no gradient of it can be summed; "
            "materialise the model first (model.to_empty(device=...) and initialise it), then build the accumulator"
        )
    site = lifetime.user_site()
    lifetime.refuse_shared(params.names, params.tensors, site)
    # last: the wrapper changes the model (FSDP2's settings, DDP's no_sync), which no later refusal may leave changed
    state = State(params, choice.group, nonfinite, float(bucket_mb), choice.make(), Window(len(params.tensors)))
    state.world, state.rank, state.device = get_world_size(state.group), get_rank(state.group), device_for(state.group)
    state.span, state.site = choice.span, site
    shapes = [params.shape_text(i) for i in range(len(params.tensors))]
    state.identity = lifetime.identify(params.names, params.tensors, lifetime.group_ranks(state.group), shapes)
    return state


def _build_layout(state: State) -> FlatLayout:
    specs = []
    sharded = state.sharded
    for i, t in enumerate(state.tensors):
        kind = "reduce_scatter" if i in sharded else "all_reduce"
        if not state.takes(i):
            kind = "external"  # the wrapper reduces it itself; only its participation is counted here
        specs.append(ParamSpec(tuple(t.shape), t.dtype, kind))  # type: ignore[arg-type]
    elem = torch.empty(0, dtype=buffer_dtype(specs)).element_size()
    w = state.wrapper
    cap = int(state.bucket_mb * _BYTES_PER_MB / elem)
    return FlatLayout(specs, state.world, state.rank, state.device, cap, w.ways, w.shard_rank)


__all__ = ["State", "build"]
