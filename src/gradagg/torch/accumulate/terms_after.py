"""Loss terms counted as the window runs: one sum per term, each divided by its own global count in ``finish()``.

An accumulator built with ``terms=("policy", "kl", ...)`` takes each backward through
``mb.backward(term, loss, count=...)`` (a :class:`Microbatch`, what ``acc.microbatch()`` yields) and each count
through that call or :meth:`~gradagg.torch.MicrobatchAccumulator.count`, at any time before ``finish()`` (a count
known only after the last microbatch, e.g. the tokens that survived a filter inside the loss). Then

    .grad = sum over terms k of ( sum over all microbatches of all ranks of term k's gradient ) / D_k

D_k being term k's counts summed over the window on all ranks. Nothing is counted ahead.

How: the hook adds a term's gradient into that term's own flat buffer; the rank's first term uses the window's
buffer, each further term one more zeroed buffer of the same layout, allocated when it first appears on the rank
and freed in ``finish()`` (memory: at most (terms - 1) x the flat buffer, on the ranks where those terms ran).
``finish()`` first all-reduces every rank's count of every term (one small float64 collective), then, on each
rank, divides each term's local sum by its global D_k into the window's buffer (one pass per term), and sends
that one buffer as without terms (D = 1): one buffer's communication, whatever the number of terms. Each rank's
sum is divided before the ranks' sums are added (the same value up to rounding). The last microbatch's backward
does not send buckets early (a term's divisor is unknown until every count is in).

Refused, on every rank at ``finish()`` (the window poisoned): a backward in a microbatch outside
``mb.backward()`` (plain ``loss.backward()``, a ``.grad`` set by hand); a term name not declared; ``weight=`` on
a microbatch; a count on any rank that is negative, NaN or infinite; a term counted 0 on all ranks while its
gradient is non-zero on some rank (a forgotten ``acc.count``). A term counted 0 whose gradient is zero or absent
everywhere contributes nothing (the ledger gives it 0). Refused at construction: FSDP2's shards form (use
``fsdp="window"``), FSDP1 (it cannot back-propagate twice through one forward: :mod:`.wrappers.fsdp1`) and DDP's
``parameters_to_ignore``; at once: ``divisors()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.torch.accumulate import hooks
from gradagg.torch.accumulate.counting import divisor_problem
from gradagg.torch.accumulate.ledger import TERMS
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.window import (
    NO_TERM,
    OK,
    TERM,
    WEIGHT,
    Into,
    Weight,
    check_weight,
    weight_sum,
    weight_values,
)
from gradagg.torch.collectives import all_reduce_sum
from gradagg.torch.modes.local import Part


@dataclass
class TermSums:
    """One window's terms on this rank: counts given, backwards run, the extra buffers, the term in the window's."""

    counts: dict[str, list[Weight]] = field(default_factory=dict)
    backwards: dict[str, int] = field(default_factory=dict)
    bufs: dict[str, torch.Tensor] = field(default_factory=dict)
    main: str | None = None


def check_names(terms: Iterable[str] | None, state: State) -> tuple[str, ...]:
    """The declared term names, checked against the accumulator's wrappers.

    Raises:
        GradaggError: a name that is not a non-empty string, a name given twice, no name; FSDP2's shards form;
            FSDP1; DDP's ``parameters_to_ignore``.
    """
    if terms is None:
        return ()
    names = tuple(terms) if not isinstance(terms, str) else (terms,)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if not names or bad or len(set(names)) != len(names):
        raise GradaggError(f"terms= takes distinct non-empty names, e.g. ('policy', 'kl'), got {terms!r}")
    refused = state.wrapper.refuses_terms()
    if refused is not None:
        raise GradaggError(refused)
    return names


def _sums(state: State) -> TermSums:
    w = state.window
    if w.term_sums is None:
        w.term_sums = TermSums({n: [] for n in state.terms}, dict.fromkeys(state.terms, 0))
    return w.term_sums


def enter(state: State, weight: Weight | None) -> None:
    """A microbatch of a terms accumulator starts: its gradients go nowhere until ``mb.backward()`` names a term."""
    w = state.window
    if weight is not None:
        w.fail(WEIGHT, f"microbatch {w.m} has weight=, but the accumulator counts loss terms: give each term's count "
                       "to mb.backward(term, loss, count=...) or acc.count(term, n)")
    w.mode = TERMS
    w.into = NO_TERM
    _sums(state)


def count(state: State, term: str, n: object) -> None:
    """Add ``n`` to this rank's count of ``term`` in the window (see ``MicrobatchAccumulator.count``)."""
    if not state.terms:
        raise GradaggError("count() needs an accumulator built with terms=(...), naming its loss terms")
    value = check_weight(n)  # a value that cannot count is refused at finish(), on every rank
    sums = _sums(state)
    if term not in sums.counts:
        state.window.fail(TERM, f"count() of loss term {term!r}, not one of the accumulator's terms {state.terms}")
        return
    sums.counts[term].append(value)


def backward(state: State, term: str, loss: torch.Tensor, n: object, retain_graph: bool | None) -> None:
    """Run ``loss.backward()`` with its gradients going into ``term``'s sum; count ``n`` (see ``Microbatch``)."""
    w = state.window
    value = None if n is None else check_weight(n)
    sums = _sums(state)
    if term not in sums.counts:
        w.fail(TERM, f"microbatch {w.m}: mb.backward() of loss term {term!r}, not one of the accumulator's terms "
                     f"{state.terms} (its backward was not run)")
        return
    hooks.take_hand_set(state)  # a .grad set by hand before it would join this term: refused (into is NO_TERM)
    w.into = _into(state, sums, term)
    try:
        loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
    finally:
        w.into = NO_TERM
    sums.backwards[term] += 1
    if value is not None:
        sums.counts[term].append(value)


def _into(state: State, sums: TermSums, term: str) -> Into:
    if sums.main is None or sums.main == term:
        sums.main = term
        return Into(term, None)
    buf = sums.bufs.get(term)
    if buf is None:
        layout = state.layout()
        buf = sums.bufs[term] = torch.zeros(layout.size, dtype=layout.dtype, device=layout.device)
    return Into(term, buf)


def settle(state: State) -> None:
    """``finish()``, before the exchange: count every term on all ranks, then divide each term's sum into the window's
    buffer. Every decision is taken from the reduced counts, the same on every rank."""
    sums, w = _sums(state), state.window
    names, world = state.terms, state.world
    local = [_local_count(state, n, weight_values(sums.counts[n])) for n in names]
    vec = torch.zeros(2 * len(names) * world, dtype=torch.float64)
    rank = state.rank
    for k, n in enumerate(names):  # every rank writes its own slots: each rank's value arrives exactly
        vec[k * world + rank] = local[k]
        vec[(len(names) + k) * world + rank] = sums.backwards[n]
    got = all_reduce_sum(vec.to(state.device), state.group).cpu().tolist()
    per_rank = {n: got[k * world : (k + 1) * world] for k, n in enumerate(names)}
    ran = {n: got[(len(names) + k) * world : (len(names) + k + 1) * world] for k, n in enumerate(names)}
    totals = {n: weight_sum(per_rank[n]) for n in names}
    _zero_unwritten(state)
    why = _problem(state, per_rank, totals) or _zero_count(state, sums, ran, totals)
    w.terms_local, w.terms = dict(zip(names, local)), totals
    if why is not None:
        w.fail(TERM, why)
    if w.status == OK:
        _divide(state, sums, totals)
    sums.bufs.clear()


def _local_count(state: State, term: str, values: list[float]) -> float:
    """This rank's count of ``term``; NaN (refused on every rank) where one of its values cannot count."""
    bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
    if bad:
        state.window.fail(TERM, f"loss term {term!r} was given count {bad[0]} on this rank: a count must be finite "
                                "and non-negative")
        return math.nan
    return weight_sum(values)


def _problem(state: State, per_rank: dict[str, list[float]], totals: dict[str, float]) -> str | None:
    dtype = state.layout().dtype
    for n, values in per_rank.items():
        bad = [(r, v) for r, v in enumerate(values) if not (math.isfinite(v) and v >= 0)]
        if bad:
            return f"loss term {n!r}: rank {bad[0][0]} counted {bad[0][1]}; a count must be finite and non-negative"
        t = totals[n]
        problem = divisor_problem(t, dtype) if t != 0 else None  # a term counting 0 is the caller's to judge
        if problem is not None:
            return f"loss term {n!r} counts {t!r} on all ranks, {problem}"
    return None


def _zero_count(state: State, sums: TermSums, ran: dict[str, list[float]], totals: dict[str, float]) -> str | None:
    """A term counted 0 everywhere but run somewhere: refused unless its gradient is exactly zero on every rank
    (one more small collective, only then)."""
    suspects = [n for n in state.terms if totals[n] == 0 and any(ran[n])]
    if not suspects:
        return None
    flags = torch.tensor([float(_nonzero(state, sums, n)) for n in suspects], dtype=torch.float64)
    got = all_reduce_sum(flags.to(state.device), state.group).cpu().tolist()
    for n, nonzero in zip(suspects, got):
        if nonzero:
            runs = [r for r, b in enumerate(ran[n]) if b]
            return (f"loss term {n!r} counts 0 on all ranks, but its gradient is non-zero (backward on rank(s) "
                    f"{runs}): nothing to divide it by; give its count (mb.backward(..., count=n) or acc.count) "
                    "before finish()")
    return None


def _nonzero(state: State, sums: TermSums, term: str) -> bool:
    """Whether this rank's sum of ``term`` holds anything but zeros (NaN included). The window's buffer is read after
    :func:`_zero_unwritten`, its counters' region (last window's values, rewritten when it leaves) left out."""
    w = state.window
    if term in sums.bufs:
        return bool(sums.bufs[term].ne(0).any())
    if term != sums.main or w.flat is None:
        return False
    nonzero = w.flat.ne(0)
    head = state.layout().buckets[-1].start
    nonzero[head : head + state.layout().n_counters] = False
    return bool(nonzero.any())


def _zero_unwritten(state: State) -> None:
    """Slots of the window's buffer not written this window hold old values (see ``FlatLayout.fresh``): zeroed now,
    as other terms' sums land there; every slot then counts as written."""
    w, layout = state.window, state.layout()
    if w.flat is None:
        return
    if layout.copies_first():
        for i in range(layout.n_params):
            if i not in w.written and layout.slots[i].bucket >= 0:
                layout.zero_slot(w.flat, i)
    w.written.update(range(layout.n_params))  # the same set the sender reads


def _divide(state: State, sums: TermSums, totals: dict[str, float]) -> None:
    w = state.window
    if w.flat is None:
        return
    with torch.no_grad():
        if sums.main is not None and totals[sums.main] > 0:
            w.flat.div_(totals[sums.main])  # the counters' region is written after this, when the last bucket leaves
        for n, buf in sums.bufs.items():
            if totals[n] > 0:
                w.flat.addcdiv_(buf, torch.tensor(totals[n], dtype=buf.dtype, device=buf.device))


class Microbatch:
    """What ``with acc.microbatch() as mb:`` gives: run each loss term's backward through :meth:`backward`.

    Ignoring it is valid for an accumulator without ``terms=``.
    """

    def __init__(self, state: State, index: int) -> None:
        self._state, self._index = state, index

    def backward(
        self, term: str, loss: torch.Tensor | Part, count: object = None, *, retain_graph: bool | None = None
    ) -> None:
        """Back-propagate ``loss`` (the term's unscaled sum over this microbatch) as loss term ``term``.

        Args:
            term: one of the accumulator's ``terms=``.
            loss: a 0-dim tensor, or a :class:`~gradagg.torch.modes.Part` (its ``weight`` is then the count).
            count: what this microbatch adds to ``term``'s divisor (a non-negative number or 0-dim tensor); None
                to count it elsewhere (another call, or ``acc.count(term, n)`` before ``finish()``).
            retain_graph: as ``Tensor.backward``: True for every term but the last sharing a forward.

        Raises:
            GradaggError: an accumulator without ``terms=``; a count with a Part; a count that is not a real number.
            WindowError: called outside this microbatch's ``with``.

        >>> from gradagg.torch import MicrobatchAccumulator
        >>> w = torch.ones(1, requires_grad=True)
        >>> acc = MicrobatchAccumulator([("w", w)], terms=("a", "b"))
        >>> with acc.microbatch() as mb:
        ...     mb.backward("a", 6 * w.sum(), count=3)   # a: 6 / 3
        ...     mb.backward("b", 8 * w.sum())            # b: 8 / 4, counted later
        >>> acc.count("b", 4)
        >>> _ = acc.finish(); w.grad
        tensor([4.])
        """
        st = self._state
        if not st.terms:
            raise GradaggError("mb.backward(term, ...) needs an accumulator built with terms=(...); "
                               "without terms, run loss.backward() inside the microbatch")
        w = st.window
        if not w.in_microbatch or w.m != self._index:
            raise WindowError(f"mb.backward({term!r}, ...) outside its microbatch's with-block")
        if isinstance(loss, Part):
            if count is not None:
                raise GradaggError(f"mb.backward({term!r}, part, count=...): a Part carries its count (its weight)")
            backward(st, term, loss.loss, loss.weight, retain_graph)
        else:
            backward(st, term, loss, count, retain_graph)


__all__ = ["Microbatch", "TermSums", "backward", "check_names", "count", "enter", "settle"]
