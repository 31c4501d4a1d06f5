"""The shards form with uneven microbatch counts: the ranks agree on each round, and a rank that ran out pads.

Why: under ``fsdp="shards"`` FSDP2 all-gathers in every forward and reduce-scatters in every backward, on
every rank of its mesh; a rank that ran out of microbatches must still join those collectives, or the others
wait for ever. So a window runs in *rounds*, one per microbatch of the rank that has the most. Before each
round one small all_reduce (4 numbers per rank) tells every rank which ranks run a microbatch now and whether
any has one after it. A rank without one runs a *padding microbatch*: a forward and backward whose gradients
are dropped in their post-accumulate-grad hooks, before FSDP sees them (FSDP then reduce-scatters zeros for
them: ``set_reduce_scatter_unused_params``), so it adds exactly zero, even where its loss is not finite,
and counts in neither M, the weights nor participation. The sums it receives from the other ranks are kept
as every round's are. A round where no rank has a microbatch ends the window's loop on every rank.

Where a round is agreed:

* in ``acc.microbatches(loader)``, before each item; once this rank's items are done, it pads round after
  round until no rank has one (the look-ahead also tells the last round, where HSDP all-reduces over the
  replicas);
* with bare ``microbatch()`` calls, at the first of the microbatch's entry and its forward's start (the root
  module's forward pre-hook: a forward written before the ``with`` would otherwise all-gather before the
  agreement), and ``finish()`` pads until no rank has one.

The padding batch (``MicrobatchAccumulator(model, pad=...)``): a function ``fn()`` that runs a forward on a
small batch and returns its loss; or ``"replay"`` (default): the inputs of every forward of the root module in
this rank's last microbatch are run again, in order, the outputs' floating tensors summed as the loss. Each forward
all-gathers (and its backward reduce-scatters): the padding must run as many forwards as the real microbatches of
its round, so a loop whose microbatches run several forwards through the model (two halves, a policy and its
reference in one module) must run the same number in every microbatch, and a ``pad=fn`` as many. A rank that
ran no forward yet borrows the inputs of the lowest rank running a microbatch in that round (one
``all_gather_object``; the inputs are then kept).
``None``: no padding; uneven counts raise GradaggError on every rank, before any FSDP collective
of the round. The padding's forward must reach the same FSDP modules as the others' (not for data-dependent
blocks: use ``fsdp="window"`` there). It runs in training mode, and counts nowhere: every buffer of the module
(counters, BatchNorm's statistics), the RNG states (dropout) and the modules' plain attributes are put back as the
padding found them (:func:`.pad_run.kept`; its boundary: a change inside an object an attribute holds).

One rank's failure in its padding (a ``pad`` function that raises, returns what cannot be back-propagated, or
calls a block before the model; replay inputs that cannot be pickled) is one GradaggError on every rank, the
window dropped: the failing rank completes the round with a stand-in where it can and the next round's
agreement carries the failure (:mod:`.pad_run`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from gradagg.errors import CollectiveError, GradaggError, first_line
from gradagg.torch.accumulate import finish, opening
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.wrappers import pad_run
from gradagg.torch.collectives import all_gather_object, all_reduce_sum, get_world_size

if TYPE_CHECKING:
    from gradagg.torch.accumulate.wrappers.pad_run import Padder

T = TypeVar("T")
_END = object()  # an exhausted iterator's marker (None may be an item)
Pad = Callable[[], torch.Tensor] | Literal["replay"] | None
Inputs = tuple[tuple[Any, ...], dict[str, Any]]
"""One forward's inputs to the root module: ``(args, kwargs)``."""
"""The padding batch: ``fn()`` returning a loss, ``"replay"`` (the last forward inputs), or None (no padding)."""


@dataclass
class Round:
    """What every rank knows about one round once it was agreed (the same on every rank).

    Attributes:
        running: the ranks that run a real microbatch in it.
        last: no rank has a microbatch after it (known with ``microbatches()``'s look-ahead only).
        known: every rank knew whether it has one after (no bare ``microbatch()`` call in the round): only then
            may HSDP defer its all-reduce over the replicas to the last round.
        source: the rank whose forward inputs are sent to a rank that has none to replay, or -1.
        shared: whether this rank took part in that exchange yet.
    """

    running: list[int]
    last: bool
    known: bool
    source: int
    world: int
    shared: bool = False

    @property
    def everyone(self) -> bool:
        """Every rank runs a real microbatch: no padding in this round."""
        return len(self.running) == self.world


class Rounds:
    """The rounds' and padding's state of a shards form (FSDP2's :class:`~.fsdp_shards.FsdpShards`, FSDP1's
    :class:`~.fsdp1.Fsdp1Shards`: each starts from it), and the wrapper methods that are the same for both.

    Args:
        pad: the padding batch (see the module docstring).
        group: the accumulator's group: in a group of more than one rank the window runs in agreed rounds.
        zero_padding_loss: a padding microbatch's loss is multiplied by zero (where no hook drops its gradients
            before the wrapper reduces them).

    Attributes:
        rounds: whether the ranks agree on every microbatch and short ranks pad (a group of more than one rank).
        pad, kept, padding, failure: the padding batch; the root module's forward inputs ``(args, kwargs)`` of
            this rank's last microbatch, one per forward (a loss of two forwards keeps two), replayed by
            ``pad="replay"``; whether a padding microbatch is running (its gradients are dropped);
            a padding failure here, told at the next round.
        agreed, done, padded: this window's round agreed for the microbatch about to run; whether a round found no
            rank with a microbatch; the padding microbatches run here.
        fresh: the root module's next forward is a new microbatch's first (``kept`` starts again).
    """

    opens_together = True  # each microbatch's round is agreed by every rank

    def __init__(self, pad: Pad, group: Any, zero_padding_loss: bool) -> None:
        self.rounds = get_world_size(group) > 1
        self.zero_padding_loss = zero_padding_loss
        self.pad, self.padding = pad, False
        self.kept: list[Inputs] | None = None
        self.fresh = True  # the next forward of the root module is a new microbatch's first
        self.failure: str | None = None
        self.agreed: Round | None = None
        self.done, self.padded = False, 0

    def microbatches(self, state: State, items: Iterable[Any]) -> Iterator[Any] | None:
        # a Padder once subclassed: the shards form adds the side
        return rounds(state, self, items) if self.rounds else None  # type: ignore[arg-type]

    def after_microbatch(self, state: State) -> None:
        self.agreed, self.fresh = None, True

    def explained(self, state: State, exc: BaseException) -> BaseException:
        return explained(state, self.agreed, exc)

    def new_rounds(self) -> None:
        """A window ends: its rounds and padding count are forgotten."""
        self.agreed, self.done, self.padded = None, False, 0


def agree(state: State, sh: Padder, now: bool, after: bool | None) -> Round:
    """One round's all_reduce: which ranks run a microbatch now, which have one after, who needs inputs.

    Args:
        now: this rank runs a real microbatch in this round.
        after: it has one after this one (None: not known, bare ``microbatch()`` calls).

    Raises:
        GradaggError: on every rank, when a rank must pad and has ``pad=None`` (the window is dropped).
    """
    world, rank = state.world, state.rank
    needs = not now and sh.pad == "replay" and sh.kept is None
    refuses = not now and sh.pad is None
    failed = sh.failure is not None
    vec = torch.zeros(6 * world, dtype=torch.float64)  # 6 rows of one slot per rank; a sum fills them all
    vec[rank::world] = torch.tensor([now, after is not False, needs, refuses, after is None, failed],
                                    dtype=torch.float64)
    got = all_reduce_sum(vec.to(state.device), state.group).cpu().view(6, world).tolist()
    if any(got[5]):
        _raise_failures(state, sh)
    running = [r for r in range(world) if got[0][r]]
    padding = 0 < len(running) < world
    refused = [r for r in range(world) if got[3][r]] if padding else []
    if refused:
        _drop(state, sh)
        raise GradaggError(
            f"rank {rank}: uneven microbatch counts in the shards form (ranks {running} run a microbatch in this "
            f"round, rank(s) {refused} have none and pad=None): FSDP2's collectives need every rank; pass "
            "MicrobatchAccumulator(model, pad=fn) (fn() returns a small batch's loss), pad='replay', or "
            "fsdp='window'; the window was dropped on every rank"
        )
    source = min(running) if padding and any(got[2]) else -1
    return Round(running, not any(got[1]), not any(got[4]), source, world)


def _drop(state: State, sh: Padder) -> None:
    finish.discard(state)
    sh.failure = None


def _raise_failures(state: State, sh: Padder) -> None:
    """A padding microbatch failed on some rank in the last round (which it completed with a stand-in): every
    rank gathers what went wrong, drops the window and raises the same error."""
    told = [t for t in all_gather_object(sh.failure, state.group) if t is not None]
    _drop(state, sh)
    raise GradaggError(f"rank {state.rank}: a padding microbatch failed: {'; '.join(map(str, told))}; "
                       "the window was dropped on every rank")


def share_inputs(state: State, sh: Padder, rnd: Round) -> None:
    """The round's exchange of forward inputs, for a rank that has none to replay (every rank calls it once).

    An ``all_gather_object`` in which only the source sends its inputs, pickled here first (the others send
    None; collectives.py has no broadcast of objects): as a rule once per accumulator, when a rank first pads
    before any forward. Inputs that cannot be pickled (a lambda keyword argument) are sent as the reason, and
    every rank raises the same GradaggError, the window dropped.
    """
    if rnd.source < 0 or rnd.shared:
        return
    rnd.shared = True
    rank = state.rank
    got = all_gather_object(_packed(sh.kept) if rank == rnd.source else None, state.group)[rnd.source]
    if isinstance(got, str):
        _drop(state, sh)
        raise GradaggError(
            f"rank {rank}: pad='replay': rank {rnd.source}'s forward inputs, borrowed by the ranks that run out "
            f"(ranks {sorted(set(range(rnd.world)) - set(rnd.running))} in this round), cannot be sent: {got}; pass "
            "pad=fn (a function running a small batch of the rank's own); the window was dropped on every rank")
    if sh.kept is None and isinstance(got, bytes):  # kept for the next windows
        sh.kept = pad_run.to_device(pickle.loads(got), state.device)  # noqa: S301 - our own ranks


def _packed(kept: object) -> bytes | str:
    """The inputs pickled, or why they cannot be."""
    try:
        return pickle.dumps(pad_run.to_cpu(kept))
    except Exception as exc:  # noqa: BLE001 - pickle raises many kinds (AttributeError for a lambda)
        return f"{type(exc).__name__}: {first_line(exc)}"


def pad_once(state: State, sh: Padder, rnd: Round) -> None:
    """Run one padding microbatch: its FSDP collectives pair with the others'; its gradients are dropped."""
    share_inputs(state, sh, rnd)
    sh.side.set_all_reduce(rnd.last or not rnd.known)
    sh.padding = True
    try:
        failure = pad_run.run(state, sh, rnd.running)
    finally:
        sh.padding = False
    if failure is not None and sh.failure is None:
        sh.failure = failure  # told at the next round's agreement, where every rank raises
    sh.padded += 1


def before_forward(state: State, sh: Padder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The root module's forward pre-hook (shards form): open the window, agree the round, keep the inputs."""
    if state.closed or sh.padding or not torch.is_grad_enabled():
        return
    if not state.window.open:
        opening.open_window(state)
    if sh.fresh or sh.kept is None:  # references only: this microbatch's inputs, replaced by the next one's
        sh.kept, sh.fresh = [], False
    sh.kept.append((args, kwargs))  # every forward of the microbatch: a padding replays as many
    if not sh.rounds:
        return
    if sh.agreed is None:
        sh.agreed = agree(state, sh, True, None)  # a bare microbatch whose forward comes first
    share_inputs(state, sh, sh.agreed)


def watch_forward(state: State, sh: Padder) -> None:
    """Register :func:`before_forward` on the root module (shards form), before FSDP's own pre-hook."""
    module = state.params.module
    if module is None:
        return

    def hook(_module: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        before_forward(state, sh, args, kwargs)

    state.extra_hooks.append(module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))


def enter(state: State, sh: Padder) -> Round | None:
    """At ``microbatch()``'s entry (window open): the round agreed for it, agreeing it here if nothing did."""
    if not sh.rounds:
        return None
    if sh.agreed is None:
        sh.agreed = agree(state, sh, True, None)
    return sh.agreed


def rounds(state: State, sh: Padder, items: Iterable[T]) -> Iterator[T]:
    """``microbatches()`` in the shards form: one round per item with look-ahead, then padding until all are done."""
    it = iter(items)
    upcoming: Any = next(it, _END)
    while True:
        current, upcoming = upcoming, (_END if upcoming is _END else next(it, _END))
        if not state.window.open:
            opening.open_window(state)
        rnd = agree(state, sh, current is not _END, upcoming is not _END)
        if not rnd.running:
            sh.done = True
            return
        if current is _END:
            pad_once(state, sh, rnd)
            continue
        sh.agreed = rnd
        state.window.next_last = rnd.last and rnd.everyone  # early bucket sends only where every rank runs the same
        yield current


def finish_rounds(state: State, sh: Padder) -> None:
    """In ``finish()``: pad until a round finds no rank with a microbatch (bare ``microbatch()`` loops)."""
    while sh.rounds and not sh.done:
        rnd = agree(state, sh, False, False)
        if not rnd.running:
            sh.done = True
        else:
            pad_once(state, sh, rnd)


def explained(state: State, rnd: Round | None, exc: BaseException) -> BaseException:
    """What a real microbatch that raised should raise instead: a CollectiveError naming the padding ranks when a
    collective failed in a round where some rank padded (a padding rank failed where no stand-in could complete
    the round: see :mod:`.pad_run`); else ``exc`` itself."""
    if rnd is None or rnd.everyone or not pad_run.backend_error(exc):
        return exc
    padders = sorted(set(range(rnd.world)) - set(rnd.running))
    return CollectiveError(
        f"rank {state.rank}: a collective failed in this microbatch, in a round where rank(s) {padders} "
        f"ran a padding microbatch (one of them probably failed in it: its own error says how): {first_line(exc)}")


def all_reduce_now(rnd: Round | None, last: bool, lookahead: bool | None) -> bool:
    """HSDP: whether this microbatch's backward all-reduces over the replicas (deferred to the last round)."""
    if rnd is not None:
        return rnd.last or not rnd.known
    return last or lookahead is None


def sends_early(sh: Padder, rnd: Round | None, last: bool) -> bool:
    """Whether this microbatch's backward may send complete buckets: in the shards form only in a last round
    that every rank runs (elsewhere a short rank's buckets would go out between the others' FSDP collectives)."""
    if not sh.rounds or not last:
        return last
    return rnd is not None and rnd.last and rnd.everyone


__all__ = [
    "Pad",
    "Round",
    "Rounds",
    "agree",
    "all_reduce_now",
    "before_forward",
    "enter",
    "explained",
    "finish_rounds",
    "pad_once",
    "rounds",
    "sends_early",
    "watch_forward",
]
