"""One accumulation window on this rank: counts, weights, participation, its buffers, and why it cannot be finished.

Everything that must make *every* rank refuse travels as a status code in the window's collective
(see :mod:`gradagg.torch.accumulate.flat`); the text here explains it on the rank where it happened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING, cast

import torch

from gradagg.errors import GradaggError
from gradagg.torch.accumulate.ledger import DIVIDED, NONE, TERMS, UNWEIGHTED, WEIGHTED
from gradagg.torch.placements import is_dtensor

if TYPE_CHECKING:
    from gradagg.torch.accumulate.buckets import Sender
    from gradagg.torch.accumulate.terms_after import TermSums

OK, RAISED, OUTSIDE, STALE, CHANGED, WEIGHT, LATE, UNSUPPORTED, PEER, KEPT, HAND_SET, TERM = range(12)
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
}

Weight = float | torch.Tensor


@dataclass
class Into:
    """Loss terms (see :mod:`.terms_after`): where the hook adds the running backward's gradients, ``buf`` None
    being the window's own buffer."""

    term: str
    buf: torch.Tensor | None


NO_TERM = Into("", None)
"""``Window.into`` in a microbatch of an accumulator with loss terms, outside ``mb.backward()``: gradients refused."""


def check_weight(weight: object) -> Weight:
    """A microbatch weight, its value taken now: a real number, or a copy of a 0-dim real tensor.

    A tensor is copied on its device (no host sync): a count the caller keeps in one tensor and updates in place
    for the next microbatch (``w.copy_(n)``) still counts the value it had here. A DTensor counts its global value
    when every rank holds it whole (``Replicate`` placements: its local tensor); a ``Partial`` one has no value here
    without a collective that ranks with other microbatch counts would not all run, and is refused.

    A value that cannot count (negative, NaN, infinite, beyond float64, a tensor on the meta device, which has
    no value) is not refused here: :func:`weight_problem` names it and ``finish()`` refuses on every rank.

    Raises:
        GradaggError: a bool, a string, a complex number, a tensor with more than one element, a DTensor that is
            not replicated, ...

    >>> check_weight(12)
    12.0
    >>> count = torch.tensor(3)
    >>> taken = check_weight(count); _ = count.fill_(5); int(taken)
    3
    >>> check_weight(True)
    Traceback (most recent call last):
    ...
    gradagg.errors.GradaggError: a microbatch weight must be a real number or a 0-dim tensor, got bool True
    """
    if isinstance(weight, torch.Tensor):
        if weight.dim() != 0 or weight.dtype == torch.bool or weight.is_complex():
            raise GradaggError(
                f"a microbatch weight tensor must be 0-dim and real, got shape {tuple(weight.shape)} {weight.dtype}"
            )
        return _local_value(weight).detach().clone()
    if isinstance(weight, bool) or not isinstance(weight, Real):
        raise GradaggError(
            f"a microbatch weight must be a real number or a 0-dim tensor, got {type(weight).__name__} {weight!r}"
        )
    try:
        return float(weight)
    except OverflowError:  # an int (or Fraction) beyond float64: refused on every rank by weight_problem
        return math.inf if cast(float, weight) > 0 else -math.inf


def _local_value(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding ``weight``'s global value: a replicated DTensor's local copy (``to_local()``, public)."""
    if not is_dtensor(weight):
        return weight
    placements = tuple(weight.placements)  # type: ignore[attr-defined]
    if not all(p.is_replicate() for p in placements):
        raise GradaggError(
            f"a microbatch weight is a DTensor with placements {placements}: only a replicated one holds its global "
            "value on every rank; pass a plain tensor or number (e.g. weight.full_tensor(), called on every rank at "
            "the same point), or a DTensor with Replicate() placements"
        )
    return cast(torch.Tensor, weight.to_local())  # type: ignore[attr-defined]


def weight_values(weights: list[Weight]) -> list[float]:
    """The weights as Python floats (tensors read in one transfer; one on the meta device reads as NaN).

    >>> weight_values([2.0, torch.tensor(3, dtype=torch.int8), torch.tensor(1.0, device="meta")])
    [2.0, 3.0, nan]
    """
    tensors = [w for w in weights if isinstance(w, torch.Tensor) and not w.is_meta]
    read = iter(torch.stack([t.double().cpu() for t in tensors]).tolist() if tensors else [])
    return [(math.nan if w.is_meta else next(read)) if isinstance(w, torch.Tensor) else w for w in weights]


def weight_problem(weights: list[Weight], values: list[float]) -> str | None:
    """The first weight that cannot count, named by its microbatch; or a sum of weights beyond float64.

    >>> weight_problem([1.0, -2.0], [1.0, -2.0])
    'microbatch 1 has weight -2.0: a weight must be finite and non-negative'
    """
    for k, (w, v) in enumerate(zip(weights, values)):
        if isinstance(w, torch.Tensor) and w.is_meta:
            return f"microbatch {k} has a weight tensor on the meta device, which holds no value to count"
        if not math.isfinite(v) or v < 0:
            return f"microbatch {k} has weight {v}: a weight must be finite and non-negative"
    if not math.isfinite(weight_sum(values)):
        return f"the {len(values)} weights of this rank's window sum beyond float64 (more than {_FLOAT64_MAX:.3e})"
    return None


_FLOAT64_MAX = 1.7976931348623157e308


def weight_sum(values: list[float]) -> float:
    """The exact sum of ``values`` rounded once (``math.fsum``), never an exception: infinite where it leaves
    float64, NaN for ``inf + -inf`` (such weights were already named by :func:`weight_problem`).

    >>> weight_sum([1e308, 1e308]), weight_sum([math.inf, -math.inf])
    (inf, nan)
    """
    try:
        return math.fsum(values)
    except OverflowError:  # the exact sum of finite values leaves float64
        return math.inf
    except ValueError:  # fsum refuses inf + -inf
        return math.nan


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
        values = weight_values(self.weights)
        problem = weight_problem(self.weights, values)
        if problem is not None:
            self.fail(WEIGHT, problem)
        self.total = weight_sum(values)

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


__all__ = ["NO_TERM", "STATUS_TEXT", "Into", "Window", "check_weight", "weight_problem", "weight_sum", "weight_values"]
