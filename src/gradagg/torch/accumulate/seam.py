"""The seam between the accumulator and a wrapper: :class:`Wrapper`, what differs between plain modules, DDP,
FSDP2's two forms and DeepSpeed ZeRO.

The accumulator's own modules (:mod:`.opening`, :mod:`.hooks`, :mod:`.finish`, the public shell) count, take
gradients into the flat buffer, exchange it and divide once, the same for every wrapper; where a wrapper differs
they call the one object :attr:`State.wrapper <.state.State.wrapper>`, through the methods below, and never ask
which wrapper it is. Each wrapper is one module of :mod:`.wrappers` (``plain``, ``ddp``, ``fsdp_window``,
``fsdp_shards``, ``deepspeed``); :func:`.wrappers.chooser` picks it from the model, as einops' ``_backends`` picks
a backend from a tensor. Adding a wrapper is writing one such module: a class with these methods (``Plain``'s do
nothing, which is what a plain module needs) and a line in the chooser.

The points where wrappers differ, in the order a window meets them:

* **which tensors hold the gradients**: :attr:`sharded` (parameters held as shards: no ``.grad`` is taken from
  them), :attr:`external` (those the wrapper reduces itself: their slot in the buffer stays empty), :meth:`held`
  (other tensors standing for a parameter during a window: FSDP2's unsharded parameters), :attr:`ways` and
  :attr:`shard_rank` (the reduce-scatter layout);
* **installing**: :meth:`install` (the gradient hooks, forward pre-hooks);
* **opening a window**: :meth:`open`, :meth:`groups` (where each kind of bucket is reduced);
* **a microbatch**: :meth:`microbatches` (the loop), :meth:`before_microbatch`, :meth:`refuse_hand_set`,
  :meth:`after_microbatch`, :meth:`explained` (what a microbatch that raised should raise);
* **the exchange**: :meth:`prepare` (before), :meth:`after_exchange`;
* **handing out**: :meth:`hand_out` (a gradient the flat buffer does not hold whole);
* **closing**: :meth:`close` (after handing out), :meth:`discard` (a window dropped);
* **releasing**: :meth:`release` (the wrapper's own synchronisation given back), and what it refuses:
  :meth:`refuses_terms`.

Every method is called on every rank at the same point of the window, so a wrapper's collectives match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from gradagg.torch.accumulate.buckets import Groups
    from gradagg.torch.accumulate.ledger import Span
    from gradagg.torch.accumulate.params import Params
    from gradagg.torch.accumulate.state import State
    from gradagg.torch.collectives import Group


class Wrapper(Protocol):
    """What a wrapper does at each point where wrappers differ (see the module docstring)."""

    name: str
    """How messages name it: ``"plain"``, ``"ddp"``, ``"fsdp window"``, ``"fsdp shards"``, ``"deepspeed"``."""
    sharded: frozenset[int]
    """Parameters held as shards (FSDP2's DTensors): their gradient reaches the accumulator through another tensor."""
    external: frozenset[int]
    """Parameters the wrapper reduces itself: only their participation is counted; their slot stays empty."""
    ways: int
    """Shards per reduce-scatter bucket (1 without sharding)."""
    shard_rank: int
    """This rank's shard in a reduce-scatter bucket."""
    opens_together: bool
    """Whether a window's opening or its microbatches run collectives every rank must join (FSDP2 unshards every
    module; the shards forms agree each microbatch's round): a rank with no microbatch then joins them in
    ``finish()``, before any other collective (see :func:`gradagg.torch.guard.due`)."""

    def held(self) -> dict[int, torch.Tensor]:
        """Parameter index -> another tensor standing for it during a window, whose ``.grad`` counts (FSDP2's
        unsharded parameters); empty where the parameters themselves hold the gradients."""

    def groups(self, group: Group) -> Groups:
        """Where each kind of bucket is reduced (the accumulator's group; FSDP2's shard and replicate groups)."""

    def install(self, state: State) -> None:
        """Hook the parameters (and the module's forward, where the wrapper needs it), once, at construction."""

    def open(self, state: State) -> None:
        """A window opens on this rank, before its buffer is allocated (FSDP2: unshard, hook the unsharded)."""

    def microbatches(self, state: State, items: Iterable[Any]) -> Iterator[Any] | None:
        """``microbatches(items)``'s loop where the wrapper runs its own (FSDP2 shards: rounds), else None."""

    def before_microbatch(self, state: State, last: bool, lookahead: bool | None) -> bool:
        """A microbatch starts (window open): the wrapper's agreement for it; whether its backward may send
        complete buckets early (``last``: marked last; ``lookahead``: what ``microbatches()`` knew, None if not
        used)."""

    def refuse_hand_set(self, state: State) -> None:
        """At a microbatch's end: fail the window for a ``.grad`` set by hand where the wrapper cannot count it."""

    def after_microbatch(self, state: State) -> None:
        """A microbatch ended, raised or not."""

    def explained(self, state: State, exc: BaseException) -> BaseException:
        """What a microbatch that raised ``exc`` should raise instead (``exc`` itself, as a rule)."""

    def prepare(self, state: State, ran: bool) -> None:
        """``finish()``, before the exchange (``ran``: the window was open, this rank ran a microbatch)."""

    def after_exchange(self, state: State) -> None:
        """``finish()``, after the exchange, before any refusal is raised: every rank is here."""

    def hand_out(self, state: State, i: int, t: torch.Tensor, divisor: float, present: bool) -> None:
        """Set ``t.grad`` (parameter ``i``, sharded or external) to its reduced gradient divided by ``divisor``
        (``present``: some rank counted it; where none did, its gradient is None as a rule)."""

    def close(self, state: State) -> None:
        """``finish()`` handed every gradient out (FSDP2: reshard; DDP: its rank-local parameters divided)."""

    def discard(self, state: State) -> None:
        """The window is dropped: every accumulated gradient was set to None; forget the wrapper's part of it."""

    def release(self) -> None:
        """Give the wrapper its own synchronisation back (the accumulator is closed)."""

    def refuses_terms(self) -> str | None:
        """Why loss terms counted as the window runs (``terms=``) cannot work here, or None."""


@dataclass(frozen=True)
class Choice:
    """The wrapper chosen for some parameters, before it changes anything: the group it reduces over, the span, and
    :attr:`make`, which builds it (configuring FSDP2's modules, entering DDP's ``no_sync()``)."""

    group: Group
    span: Span
    make: Callable[[], Wrapper]


Choose = Callable[["Params", "Group", "Span"], Choice]
"""What :func:`~gradagg.torch.accumulate.state.build` calls to choose the parameters' wrapper (see
:func:`gradagg.torch.accumulate.wrappers.chooser`)."""


__all__ = ["Choice", "Choose", "Wrapper"]
