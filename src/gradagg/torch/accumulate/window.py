"""One accumulation window on this rank: counts, weights, participation, its buffers, and why it cannot be finished.

Everything that must make *every* rank refuse travels as a status code in the window's collective
(see :mod:`gradagg.torch.accumulate.flat`); the text here explains it on the rank where it happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

# the counting rules, shared with the pipeline (gradagg.torch.pipeline); re-exported: importers keep their names
from gradagg.torch.accumulate.counting import Tally, Weight, check_weight, weight_problem, weight_sum, weight_values
from gradagg.torch.accumulate.ledger import DIVIDED, NONE, TERMS, UNWEIGHTED, WEIGHTED

if TYPE_CHECKING:
    from gradagg.torch.accumulate.buckets import Sender
    from gradagg.torch.accumulate.terms_after import TermSums

OK, RAISED, OUTSIDE, STALE, CHANGED, WEIGHT, LATE, UNSUPPORTED, PEER, KEPT, HAND_SET, TERM, READ = range(13)
STATUS_TEXT = {
    RAISED: "poisoned (a microbatch raised after gradients were accumulated)",
    OUTSIDE: "poisoned (a backward ran outside microbatch(): not counted in M)",
    STALE: "had gradients before its window",
    CHANGED: "accumulates other parameters than when it was built (one unfrozen or replaced)",
    WEIGHT: "had an invalid or inconsistent microbatch weight",
    LATE: "accumulated a gradient after the microbatch marked last (or after its bucket was sent)",
    UNSUPPORTED: "got a gradient the accumulator cannot hold (sparse)",
    PEER: "refused an earlier finish() of this window (another rank failed in it)",
    KEPT: "let FSDP sum microbatches into a bf16 or fp16 .grad (fsdp='every_microbatch')",
    HAND_SET: "had a .grad set by hand where no microbatch can count it (between microbatches, or on a shard)",
    TERM: "could not count its loss terms (see the message of the rank named)",
    READ: "had a held gradient read before finish() (a norm, clip or step by a name the guard could not replace)",
}


@dataclass
class Into:
    """Loss terms (see :mod:`.terms_after`): where the hook adds the running backward's gradients, ``buf`` None
    being the window's own buffer."""

    term: str
    buf: torch.Tensor | None


NO_TERM = Into("", None)
"""``Window.into`` in a microbatch of an accumulator with loss terms, outside ``mb.backward()``: gradients refused."""


@dataclass
class Window:
    """The counters of the current window on this rank, the same for every wrapper (a wrapper's own part of a
    window is the wrapper's: see :mod:`.seam`)."""

    params: int
    open: bool = False
    in_microbatch: bool = False
    in_last: bool = False
    last_done: bool = False
    seen: set[int] = field(default_factory=set)
    written: set[int] = field(default_factory=set)  # parameters with a gradient in the buffer this window
    m: int = 0
    participation: list[int] = field(default_factory=list)
    weights: list[Weight] = field(default_factory=list)
    mode: int = NONE
    status: int = OK
    poison: str | None = None
    terms_local: dict[str, float] | None = None
    terms: dict[str, float] | None = None
    # the window's buffers, set when it opens (see gradagg.torch.accumulate.opening)
    flat: torch.Tensor | None = None  # the input buffer: every gradient and the counters
    out: torch.Tensor | None = None  # where reduce-scatter segments land (sharded parameters)
    sender: Sender | None = None
    # loss terms counted as the window runs (see gradagg.torch.accumulate.terms_after); None without terms=
    into: Into | None = None  # the buffer the hook adds into: None is flat, the one path without terms
    term_sums: TermSums | None = None
    total: float | None = None  # the weights' sum, once settle_weights() read them
    running: Weight | None = None  # the running microbatch's weight (see MicrobatchAccumulator._end_microbatch)
    # set by microbatches()' look-ahead: whether the next microbatch is the rank's last. Window state, so that a
    # loop that left microbatches() early (continue past its last item, break) leaves nothing to the next window
    next_last: bool | None = None
    outside: str | None = None  # the first parameter a backward outside microbatch() reached before it opened

    def __post_init__(self) -> None:
        self.participation = [0] * self.params

    def fail(self, status: int, why: str) -> None:
        """Mark the window unfinishable (the first reason wins); finish() then refuses on every rank."""
        if self.status == OK:
            self.status, self.poison = status, why

    def note_weighting(self, weight: Weight | None) -> None:
        """Check that this microbatch is counted the way the window's earlier ones were."""
        mode = WEIGHTED if weight is not None else UNWEIGHTED
        if self.mode == DIVIDED and weight is not None:
            self.fail(WEIGHT, f"microbatch {self.m} has a weight, but the loss terms were divided ahead (divisors())")
        elif self.mode in (UNWEIGHTED, WEIGHTED) and mode != self.mode:
            first = "weighted" if self.mode == WEIGHTED else "unweighted"
            self.fail(
                WEIGHT,
                f"microbatch {self.m} is {'weighted' if weight is not None else 'unweighted'} "
                f"but the window's first was {first}: weight every microbatch or none",
            )
        elif self.mode == NONE:
            self.mode = mode

    def settle_weights(self) -> None:
        """Read the weights once (one device read), fail the window for one that cannot count, keep their sum."""
        read = Tally(self.weights).read()  # the pipeline's counts are read by the same rule
        if read.problem is not None:
            self.fail(WEIGHT, read.problem)
        self.total = read.total

    def weight_total(self) -> float:
        """This rank's total weight (infinite or NaN where a weight cannot count: its status says so)."""
        return self.total if self.total is not None else weight_sum(weight_values(self.weights))

    def local_divisor(self) -> float | None:
        """This rank's own D, for the parameters kept rank-local (DDP's ``parameters_to_ignore``, see
        :mod:`.wrappers.ddp`): its M, its total weight, or 1 for loss terms divided ahead (by their global totals);
        None where it counted nothing (no microbatch, or a total weight of 0)."""
        if self.mode in (DIVIDED, TERMS):
            return 1.0
        total = self.weight_total() if self.mode == WEIGHTED else float(self.m)
        return total if total > 0 else None

    def complete(self, weight: Weight | None) -> None:
        """A microbatch ended without raising: count it, its weight and its participation."""
        self.m += 1
        for i in self.seen:
            self.participation[i] += 1
        if weight is not None:
            self.weights.append(weight)


__all__ = [
    "NO_TERM", "STATUS_TEXT", "Into", "Weight", "Window",
    "check_weight", "weight_problem", "weight_sum", "weight_values",  # from .counting
]
