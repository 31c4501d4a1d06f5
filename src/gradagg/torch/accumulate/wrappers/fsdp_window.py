"""FSDP2's window form (``fsdp="window"``): parameters unsharded over the window, one reduce-scatter at its end.

Every rank unshards every FSDP module when a window opens (:meth:`~.fsdp.FsdpParams.unshard`, the same
all-gathers in module order on every rank), and FSDP never reduces: forwards and backwards send nothing,
however many microbatches each rank runs. The unsharded parameters' gradients are hooked into the
accumulator's reduce-scatter buckets; ``finish()`` reduce-scatters them (HSDP: then all-reduces the shard over
the replicas), and each sharded parameter's ``.grad`` becomes a DTensor of its rows. See :mod:`.fsdp`.
"""

from __future__ import annotations

import torch

from gradagg.torch.accumulate import hooks, opening
from gradagg.torch.accumulate.buckets import Groups
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.window import HAND_SET
from gradagg.torch.accumulate.wrappers.fsdp import FsdpParams
from gradagg.torch.accumulate.wrappers.plain import Plain
from gradagg.torch.collectives import Group


class FsdpWindow(Plain):
    """The :class:`~gradagg.torch.accumulate.seam.Wrapper` of FSDP2's window form.

    Args:
        side: the FSDP modules and sharded parameters (configured for this form).
        sharded: the indices of the sharded parameters among the accumulator's.
    """

    name = "fsdp window"
    opens_together = True  # every rank unshards every FSDP module as a window opens

    def __init__(self, side: FsdpParams, sharded: frozenset[int]) -> None:
        super().__init__()
        self.side, self.sharded = side, sharded
        self.ways, self.shard_rank = side.ways, side.shard_rank
        self.unsharded: dict[int, torch.Tensor] = {}  # while a window is open: index -> its unsharded tensor

    def held(self) -> dict[int, torch.Tensor]:
        return self.unsharded

    def groups(self, group: Group) -> Groups:
        return Groups(group, self.side.shard_group, self.side.replicate_group)

    def install(self, state: State) -> None:
        super().install(state)
        module = state.params.module
        if module is None:
            return

        def open_first(_module: object, _args: object) -> None:
            # a forward before the first microbatch() would all-gather in forward order: open (unshard) first
            if torch.is_grad_enabled() and not state.window.open and not state.closed:
                opening.open_window(state)

        state.extra_hooks.append(module.register_forward_pre_hook(open_first, prepend=True))

    def open(self, state: State) -> None:
        for name, t in self.side.unshard().items():
            i = state.names.index(name)
            self.unsharded[i] = t
            hooks.hook(state, t, i, self.taken)

    def taken(self, state: State, i: int, param: torch.Tensor) -> None:
        """An unsharded parameter's gradient: into the buffer (:func:`~gradagg.torch.accumulate.hooks.on_grad`)."""
        hooks.on_grad(state, i, param)

    def refuse_hand_set(self, state: State) -> None:
        for i in sorted(self.sharded):
            if state.tensors[i].grad is not None:
                state.window.fail(HAND_SET, f"parameter {state.names[i]!r}: a .grad was set on its shard in a window")

    def hand_out(self, state: State, i: int, t: torch.Tensor, divisor: float, present: bool) -> None:
        out = state.window.out
        t.grad = None if out is None or not present else self.side.sharded_grad(t, state.layout().local_view(out, i))

    def close(self, state: State) -> None:
        for t in self.unsharded.values():
            t.grad = None
        self.side.reshard()

    def discard(self, state: State) -> None:
        if state.window.open:
            self.side.reshard()

    def release(self) -> None:
        self.side.restore()


__all__ = ["FsdpWindow"]
