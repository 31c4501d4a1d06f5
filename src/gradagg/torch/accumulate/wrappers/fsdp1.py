"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) under the accumulator: its shards form.

FSDP1 reduce-scatters each unit's flat gradient in every backward, averaging over its ranks, and adds the shard
into the sharded ``.grad`` (in the parameters' own dtype; with ``MixedPrecision`` after casting the reduced shard
back to it). gradagg registers one communication hook on each FSDP1 root (``FSDP.register_comm_hook``, public)
that reduces a plain SUM instead: after the window's microbatches each rank's ``.grad`` shard holds the sum over
every microbatch of every rank, and ``finish()`` divides it by the counted D, once. FSDP1's collectives run in
every forward and backward, so with uneven microbatch counts the ranks agree on each round and a rank that ran
out pads, as FSDP2's shards form does (:mod:`.padding`): the hook zeroes a padding microbatch's gradient before
the reduce, so it adds exactly zero; the sums it receives from the other ranks are kept.

``HYBRID_SHARD`` (and ``_HYBRID_SHARD_ZERO2``): FSDP1 calls no communication hook for hybrid strategies, so its
own reduction stays: each microbatch's gradient averaged over the whole data-parallel world (shards times
replicas; a reduce-scatter within the node, an all-reduce across, divided by that world once). Summed over the
window into ``.grad`` that is the window's sum over ``world``, and ``finish()`` divides it by ``D / world`` (a
division more than the hook's path: one more rounding). A padding microbatch cannot be dropped before FSDP1's
reduction there, so its loss is multiplied by zero (its gradient is exactly zero where the padding forward is
finite; a non-finite padding forward reaches the window as NaN, which ``nonfinite="raise"`` refuses). The
accumulator's group is then the whole data-parallel world (the default group), not FSDP1's intra-node group.

What it takes: ``FULL_SHARD``, ``SHARD_GRAD_OP`` and the hybrid strategies; ``use_orig_params`` True (the
optimizer holds the original parameters, each a 1-d view of this rank's piece, empty on some ranks) or False (the
flat parameters); nested units (an auto-wrap policy); ``MixedPrecision`` with float32 parameters (each microbatch
is reduced in ``reduce_dtype``, the window's sum kept in float32); ``NO_SHARD`` on one rank (FSDP1's own choice in
a world of one: its average over one rank changes nothing, as under the hybrid strategies no hook is called).
Refused when the accumulator is built, on every rank, naming what works: hybrid units beside others, ``NO_SHARD``
over several ranks (FSDP1 reduces the whole accumulated ``.grad`` again at every backward: use DDP),
``fsdp="window"``, parameters in bf16 or fp16 or ``keep_low_precision_grads`` (the window's sum would be kept in that
dtype: 256 + 1 = 256 in bf16), a communication hook of the user's own, ``terms=`` (see below).

Why no ``terms=``: it runs one backward per loss term, often through one forward, and FSDP1 frees the gathered
parameters after a backward, so a second backward through the same forward fails inside FSDP1 (with or without
gradagg; a test pins it). Terms from separate forwards would each be a reduce-scatter of their own, which every rank
would have to run in the same order in every round, a padding rank one per term. Terms divided ahead
(``acc.divisors()``: one backward of their sum) are exact here.

Participation: FSDP1 reduces whole flat parameters (zeros for a parameter a microbatch did not use), so which
parameter a microbatch reached cannot be observed; the ledger counts every parameter in each microbatch that ran
a backward (seen by the communication hook, or under the hybrid strategies by a backward pre-hook on each root).
The divisor never depends on it.

FSDP1 cannot remove a communication hook: it stays registered once the accumulator is closed and then averages
over the ranks, as FSDP1's own reduction does (a later accumulator takes it over).

Why no window form: FSDP1 all-gathers the parameters in every forward and offers no public way to keep them
unsharded between forwards (``summon_full_params`` forbids a forward inside it), so a window form would still run
collectives per microbatch, and pad, as this form does; ``fsdp="window"`` is refused, naming this form.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from gradagg.errors import GradaggError, WindowError
from gradagg.torch.accumulate.counting import divisor_problem
from gradagg.torch.accumulate.flat import all_finite
from gradagg.torch.accumulate.params import fsdp1_class
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.window import OUTSIDE
from gradagg.torch.accumulate.wrappers import padding
from gradagg.torch.accumulate.wrappers.pad_run import Sides
from gradagg.torch.accumulate.wrappers.padding import Pad, Rounds
from gradagg.torch.accumulate.wrappers.plain import Plain
from gradagg.torch.collectives import Group, get_world_size, reduce_scatter_sum_async

HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


class _NoReplicas:
    """FSDP1 chooses itself when it all-reduces across replicas (the hybrid strategies: every backward)."""

    def set_all_reduce(self, now: bool) -> None:
        return


class _Hook:
    """The communication hook of one FSDP1 root (and every unit under it): a SUM over FSDP1's group.

    Args:
        group: the FSDP1 units' process group.
        world: its size.
    """

    def __init__(self, group: Group, world: int) -> None:
        self.group, self.world = group, world
        self.owner: tuple[Fsdp1Shards, State] | None = None  # the accumulator holding it, while one is alive

    def __call__(self, _state: object, grad: torch.Tensor, output: torch.Tensor) -> None:
        owner = self.owner
        if owner is None:
            grad.div_(self.world)  # no accumulator: FSDP1's own average over the ranks
        elif owner[0].padding:
            grad.zero_()  # a padding microbatch adds exactly zero, whatever its loss was
        else:
            owner[0].reduced(owner[1])
        reduce_scatter_sum_async(output, grad, self.group).wait()


_HOOKS: weakref.WeakKeyDictionary[nn.Module, _Hook] = weakref.WeakKeyDictionary()


def own_average(module: nn.Module) -> bool:
    """Whether FSDP1 reduces ``module``'s units with its own average, calling no communication hook: the hybrid
    strategies, and ``NO_SHARD`` on one rank (FSDP1 switches to it by itself in a world of one, where its
    all-reduce of the accumulated ``.grad`` is the identity). All or none, checked by :func:`refusal`."""
    cls = fsdp1_class()
    return any(_own(_strategy(m)) for m in module.modules() if cls is not None and isinstance(m, cls))


def _own(strategy: str) -> bool:
    return strategy in HYBRID or strategy == "NO_SHARD"


def _strategy(unit: nn.Module) -> str:
    return str(getattr(getattr(unit, "sharding_strategy", None), "name", "?"))


def refusal(module: nn.Module, mode: str, world: int) -> str | None:
    """Why the accumulator cannot hold this FSDP1 model (see the module docstring), or None.

    Args:
        module: the module given to the accumulator.
        mode: the ``fsdp=`` form asked for.
        world: the accumulator group's size.
    """
    if mode == "window":
        return ("fsdp='window' is not built for FSDP1 (FullyShardedDataParallel): FSDP1 all-gathers the parameters "
                "in every forward, so a window would still pad as the default fsdp='shards' does; use that, or "
                "FSDP2's fully_shard, which has both forms")
    cls = fsdp1_class()
    kinds = set()
    for name, unit in module.named_modules():
        if cls is None or not isinstance(unit, cls):
            continue
        where = f"FSDP1 unit {name!r}" if name else "the FSDP1 module given"
        strategy = _strategy(unit)
        kinds.add(_own(strategy))
        if len(kinds) > 1:
            return (f"{where} uses {strategy} beside units of another kind (hybrid or NO_SHARD, and not): FSDP1 "
                    "reduces the two differently; use one sharding strategy for every unit")
        pg = getattr(unit, "process_group", None)
        ways = pg.size() if pg is not None else world
        if strategy == "NO_SHARD" and ways > 1:
            return (f"{where} uses NO_SHARD over {ways} ranks: FSDP1 then all-reduces the whole accumulated .grad "
                    "again at every backward, counting earlier microbatches once more; use DDP "
                    "(DistributedDataParallel), which gradagg keeps exact, or FULL_SHARD / SHARD_GRAD_OP")
        if getattr(getattr(unit, "mixed_precision", None), "keep_low_precision_grads", False):
            return (f"{where} sets MixedPrecision(keep_low_precision_grads=True): FSDP1 would sum the window's "
                    "microbatches in the low-precision dtype; leave it False (gradients kept in float32)")
        if strategy in HYBRID and world % ways:
            return (f"{where} shards over {ways} ranks within a replica, which does not divide the accumulator's "
                    f"group of {world}: give the accumulator the whole data-parallel world (group=None)")
        if strategy not in HYBRID and ways != world:
            return (f"{where} shards over {ways} ranks but the accumulator's group has {world}: give the "
                    "accumulator FSDP1's process group")
    low = next(((n, p.dtype) for n, p in module.named_parameters()
                if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)), None)
    if low is not None:
        return (f"parameter {low[0]!r} is {low[1]}: FSDP1 sums the window's microbatches into .grad in the "
                "parameters' dtype (256 + 1 = 256 in bfloat16); keep the parameters in float32 and compute in "
                "low precision with FSDP1's MixedPrecision(param_dtype=torch.bfloat16)")
    return None


class Fsdp1Shards(Rounds, Plain):
    """The :class:`~gradagg.torch.accumulate.seam.Wrapper` of FSDP1 (see the module docstring).

    Args:
        roots: the outermost FSDP1 units (their hook covers every unit under them).
        n_params: the accumulator's parameters, all reduced by FSDP1 (external).
        pad: the padding microbatch (see :mod:`.padding`).
        group: the accumulator's group (FSDP1's; under the hybrid strategies the whole data-parallel world): in a
            group of more than one rank the window runs in agreed rounds.
        hybrid: the units use a hybrid strategy: FSDP1 averages over ``group`` itself (no hook).

    Attributes:
        rounds, pad, kept, padding, failure, agreed, done, padded, zero_padding_loss: the rounds' state
            (:class:`.padding.Rounds`); the padding's loss is multiplied by zero under the hybrid strategies, where
            no hook drops its gradient.
    """

    name = "fsdp1 shards"

    def __init__(self, roots: list[nn.Module], n_params: int, pad: Pad, group: Group, hybrid: bool = False) -> None:
        Plain.__init__(self)
        Rounds.__init__(self, pad, group, zero_padding_loss=hybrid)
        self.hybrid = hybrid
        self.external = frozenset(range(n_params))
        self.roots, self.group = roots, group
        self._side = _NoReplicas()
        self._hooks: list[_Hook] = []

    @property
    def side(self) -> Sides:
        return self._side

    def install(self, state: State) -> None:
        padding.watch_forward(state, self)
        if self.hybrid:
            for root in self.roots:  # no communication hook to see the backwards: a backward pre-hook on the root

                def seen(_module: nn.Module, _grads: object) -> None:
                    if not self.padding:
                        self.reduced(state)

                state.extra_hooks.append(root.register_full_backward_pre_hook(seen))
            return
        for root in self.roots:
            hook = _HOOKS.get(root)
            if hook is None:
                hook = _Hook(self.group, get_world_size(self.group))
                try:
                    root.register_comm_hook(None, hook)  # type: ignore[operator]
                except AssertionError as exc:  # FSDP1 asserts: a hook is registered already, or not a root
                    raise GradaggError(f"FSDP1 refused gradagg's communication hook ({exc}): gradagg needs its own "
                                       "to sum the microbatches; remove yours (FSDP1 takes one per root)") from exc
                _HOOKS[root] = hook
            hook.owner = (self, state)
            self._hooks.append(hook)

    def reduced(self, state: State) -> None:
        """A real microbatch's backward reached FSDP1 (its hook, or the hybrid strategies' pre-hook): count every
        parameter present in it (see the module docstring), or fail the window for a backward outside
        ``microbatch()``."""
        w = state.window
        if w.in_microbatch:
            w.seen.update(self.external)
        elif w.open:
            w.fail(OUTSIDE, "an FSDP1 backward ran outside microbatch() (not counted in M)")

    def before_microbatch(self, state: State, last: bool, lookahead: bool | None) -> bool:
        rnd = padding.enter(state, self)  # the round, agreed with the other ranks (a rank that ran out pads)
        return padding.sends_early(self, rnd, last)

    def prepare(self, state: State, ran: bool) -> None:
        padding.finish_rounds(state, self)  # a rank with none pads while the others still run theirs
        sender = state.window.sender
        if sender is not None and sender.finite is not None:
            for t in state.tensors:
                if t.grad is not None:
                    sender.finite &= all_finite(t.grad)

    def hand_out(self, state: State, i: int, t: torch.Tensor, divisor: float, present: bool) -> None:
        """Divide FSDP1's summed shard in ``t.grad`` by D (under the hybrid strategies, FSDP1's sum of averages by
        D / world); None where no rank ran a backward.

        Raises:
            WindowError: on every rank (D is the same on each) when the gradient's dtype cannot divide by D.
        """
        grad = t.grad
        if grad is None or not present:
            t.grad = None
            return
        share = divisor / state.world if self.hybrid else divisor
        problem = divisor_problem(share, grad.dtype)
        if problem is not None:
            raise WindowError(f"rank {state.rank}: the window's total weight D = {divisor!r} ({share!r} to divide "
                              f"by), which {problem}; nothing was stepped")
        if share != 1:
            grad.div_(share)

    def close(self, state: State) -> None:
        state.padded_last = self.padded
        self.new_rounds()

    def discard(self, state: State) -> None:
        self.padding = False
        self.new_rounds()

    def release(self) -> None:
        for hook in self._hooks:
            if hook.owner is not None and hook.owner[0] is self:
                hook.owner = None  # FSDP1's own average again
        self._hooks = []

    def refuses_terms(self) -> str | None:
        return ("terms= under FSDP1: FSDP1 cannot back-propagate twice through one forward (it frees the gathered "
                "parameters after the first backward), and terms= runs one backward per term; count the terms ahead "
                "with acc.divisors({...}) and back-propagate their sum once, or, for a count known only after the "
                "backward, use FSDP2's fully_shard with fsdp='window'")


__all__ = ["Fsdp1Shards", "refusal"]
