"""FSDP2's shards form (``fsdp="shards"``): FSDP reduces each microbatch; the shards are summed here, divided once.

FSDP would add each microbatch's shard into ``.grad`` in the parameter's dtype: for bf16 parameters a sum of
M microbatches in bf16 (256 + 1 rounds to 256). Here the sum is kept in float32 at least, and ``.grad``
stays None until ``finish()``. FSDP calls the sharded parameter's post-accumulate-grad hooks after each
reduce (for optimizers in backward); where it does not (compiled autograd), it keeps the sum in ``.grad``:
:meth:`FsdpShards.hand_out` folds that in, and :func:`kept_by_fsdp` refuses it in bf16 or fp16. Participation is
counted on the unsharded parameters, hooked when a window opens (:func:`~gradagg.torch.accumulate.hooks.on_grad`).

With uneven microbatch counts the ranks agree on each round and a rank that ran out pads (:mod:`.padding`): the
rounds, the padding's inputs and its failures are this wrapper's own state, the fields below.
"""

from __future__ import annotations

import torch

from gradagg.torch.accumulate import hooks
from gradagg.torch.accumulate.flat import all_finite
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.window import HAND_SET, KEPT
from gradagg.torch.accumulate.wrappers import padding
from gradagg.torch.accumulate.wrappers.fsdp import FsdpParams, low_precision
from gradagg.torch.accumulate.wrappers.fsdp_window import FsdpWindow
from gradagg.torch.accumulate.wrappers.padding import Pad, Rounds
from gradagg.torch.collectives import Group
from gradagg.torch.placements import local_tensor


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(dtype=torch.promote_types(torch.float32, t.dtype), copy=True)


class FsdpShards(Rounds, FsdpWindow):
    """The :class:`~gradagg.torch.accumulate.seam.Wrapper` of FSDP2's shards form.

    Args:
        side: the FSDP modules and sharded parameters (configured for this form).
        sharded: the indices of the sharded parameters among the accumulator's (FSDP reduces them: external).
        pad: the padding microbatch (see :mod:`.padding`).
        group: the accumulator's group: in a group of more than one rank the window runs in agreed rounds.

    Attributes:
        rounds, pad, kept, padding, failure, agreed, done, padded: the rounds' state (:class:`.padding.Rounds`).
        sums: this window's shards FSDP reduced, summed in float32 at least, by parameter index.
    """

    name = "fsdp shards"

    def __init__(self, side: FsdpParams, sharded: frozenset[int], pad: Pad, group: Group) -> None:
        FsdpWindow.__init__(self, side, sharded)
        # its padding's gradients are dropped in their hooks, before FSDP sees them: no zero loss
        Rounds.__init__(self, pad, group, zero_padding_loss=False)
        self.external = sharded
        self.sums: dict[int, torch.Tensor] = {}

    def install(self, state: State) -> None:
        for i, t in enumerate(state.tensors):
            hooks.hook(state, t, i, self.on_shard if i in self.sharded else self.taken)
        padding.watch_forward(state, self)

    def taken(self, state: State, i: int, param: torch.Tensor) -> None:
        """:func:`~gradagg.torch.accumulate.hooks.on_grad`, except in a padding microbatch, whose gradients are
        dropped (counted nowhere; FSDP then reduce-scatters zeros for an unsharded parameter, whatever the padding's
        loss was)."""
        if self.padding:
            param.grad = None
            return
        hooks.on_grad(state, i, param)

    def on_shard(self, state: State, i: int, param: torch.Tensor) -> None:
        """FSDP just reduce-scattered a microbatch into the sharded ``param.grad``: add it to the window's sum."""
        grad = param.grad
        if grad is None or not state.window.open:
            return  # before any window: left in .grad, so the next window refuses it as stale
        local = local_tensor(grad)
        total = self.sums.get(i)
        if total is None:
            self.sums[i] = _wide(local)
        else:
            total.add_(local.detach())
        param.grad = None

    def before_microbatch(self, state: State, last: bool, lookahead: bool | None) -> bool:
        rnd = padding.enter(state, self)  # the round, agreed with the other ranks (a rank that ran out pads)
        self.side.set_all_reduce(padding.all_reduce_now(rnd, last, lookahead))
        return padding.sends_early(self, rnd, last)

    def refuse_hand_set(self, state: State) -> None:
        for i in sorted(self.sharded):
            unsharded = self.unsharded.get(i)
            if unsharded is not None and unsharded.grad is not None:
                # FSDP's backward already reduced and cleared it; a later one would absorb this
                state.window.fail(HAND_SET, f"parameter {state.names[i]!r}: a .grad was set after FSDP reduced it")

    def prepare(self, state: State, ran: bool) -> None:
        padding.finish_rounds(state, self)  # a rank with none pads while the others still run theirs
        kept = kept_by_fsdp(state, self.sharded) if ran else None
        if kept is not None:
            state.window.fail(KEPT, kept)
        sender = state.window.sender
        if sender is not None and sender.finite is not None:
            for i in sorted(self.external):
                g = state.tensors[i].grad
                if g is not None:
                    sender.finite &= all_finite(local_tensor(g))
            for total in self.sums.values():
                sender.finite &= all_finite(total)

    def hand_out(self, state: State, i: int, t: torch.Tensor, divisor: float, present: bool) -> None:
        """Parameter ``i``'s summed shards divided by D, as a DTensor gradient (None if none, or absent everywhere:
        FSDP reduce-scatters zeros for a parameter no microbatch used)."""
        total = self.sums.pop(i, None)
        if t.grad is not None:  # FSDP summed (some of) it into .grad itself: its hook did not run
            kept = local_tensor(t.grad)
            total = _wide(kept) if total is None else total.add_(kept.detach())
        if total is None or not present:
            t.grad = None
            return
        if divisor != 1:
            total.div_(divisor)
        t.grad = self.side.sharded_grad(t, total)

    def close(self, state: State) -> None:
        super().close(state)
        state.padded_last = self.padded
        self._new_window()

    def discard(self, state: State) -> None:
        self.padding = False
        self._new_window()

    def _new_window(self) -> None:
        self.new_rounds()
        self.sums = {}

    def refuses_terms(self) -> str | None:
        return ("terms= under fully_shard needs fsdp='window': the shards form reduces each backward itself, "
                "so the ranks would have to run the same term backwards in every microbatch")


def kept_by_fsdp(state: State, sharded: frozenset[int]) -> str | None:
    """Why a shard FSDP summed into ``.grad`` itself cannot count (a bf16 or fp16 sum), or None."""
    for i in sorted(sharded):
        g = state.tensors[i].grad
        if g is not None and low_precision(g.dtype):
            return (
                f"parameter {state.names[i]!r}: FSDP summed microbatches into its {g.dtype} .grad itself (its "
                "post-accumulate-grad hooks did not run, e.g. under compiled autograd); use fsdp='window'"
            )
    return None


__all__ = ["FsdpShards", "kept_by_fsdp"]
