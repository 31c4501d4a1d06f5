"""The end of an accumulation window: send, check on every rank, divide once, hand out the gradients.

Kept apart from :mod:`gradagg.torch.accumulate` (the window's public API) because it is the one long
sequence; each step is a small function. Every decision below is taken from the *reduced* counters, which
are the same on every rank, so every rank raises, or succeeds, together.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from gradagg.errors import CollectiveError, GradaggError, NonFiniteGradientError, WindowError
from gradagg.torch._flat import Counts, all_finite, real_dtype
from gradagg.torch._window import (
    DIVIDED,
    KEPT,
    NONE,
    OK,
    PEER,
    STALE,
    STATUS_TEXT,
    WEIGHT,
    WEIGHTED,
    check_weight,
    weight_problem,
    weight_values,
)
from gradagg.torch.collectives import (
    Group,
    all_reduce_sum,
    check_same_on_all_ranks,
    device_for,
    get_rank,
    get_world_size,
)
from gradagg.torch.ledger import WEIGHTING, Ledger

if TYPE_CHECKING:
    from gradagg.torch._core import AccumulatorCore
    from gradagg.torch.accumulate import MicrobatchAccumulator


def finish(acc: MicrobatchAccumulator) -> Ledger:
    """:meth:`MicrobatchAccumulator.finish` after its argument checks (see there)."""
    _prepare(acc)
    counts = _exchange(acc)
    _raise_if_any_failed(acc, counts)
    m = sum(counts.per_rank)
    if m == 0:
        acc.discard()
        raise WindowError("finish() with no microbatch run on any rank (M = 0): there is no mean to take")
    mode = max(counts.modes)
    divisor = _divisor(mode, m, counts)
    if mode == WEIGHTED and divisor == 0:
        acc.discard()
        raise WindowError(f"the total weight of the window is 0 over {m} microbatches: there is no mean to take")
    if divisor != 1 and acc._flat is not None:
        acc._layout_now().divide(acc._flat, acc._out, divisor)
    _install(acc, counts, divisor)
    if acc._fsdp is not None:
        acc._fsdp.reshard()
    ledger = local_ledger(acc, counts, divisor, mode)
    _close_window(acc, ledger)
    if counts.nonfinite:
        names = [n for n, t in zip(acc._names, acc._tensors) if t.grad is not None and not bool(all_finite(t.grad))]
        raise NonFiniteGradientError(
            f"rank {get_rank(acc._group)}: non-finite gradients on rank(s) {counts.nonfinite}, in {names} after the "
            "reduction; every rank raises, with the same reduced (non-finite) gradients in .grad: zero them and skip "
            "this step"
        )
    return ledger


def _prepare(acc: MicrobatchAccumulator) -> None:
    """Open the window of a rank that ran no microbatch; record what only now can be checked."""
    w = acc._w
    if not w.open:
        stale = acc._stale_param()
        acc._open_window(empty=True)
        if stale is not None:
            w.fail(STALE, f"parameter {stale!r} has a gradient, yet this rank ran no microbatch (zero_grad skipped?)")
    else:
        acc._check_params()
        kept = acc._kept_by_fsdp()
        if kept is not None:
            w.fail(KEPT, kept)
    problem = weight_problem(weight_values(w.weights))
    if problem is not None:
        w.fail(WEIGHT, problem)


def _exchange(acc: MicrobatchAccumulator) -> Counts:
    """Send every bucket that has not left yet, the counters with the last; wait; read the counters."""
    w, layout, sender = acc._w, acc._layout_now(), acc._sender
    if sender is None or acc._flat is None:
        raise RuntimeError("internal error: an open window without its buffer")
    if sender.finite is not None:
        for i in _external(acc):
            g = acc._tensors[i].grad
            if g is not None:
                sender.finite &= all_finite(g.to_local())  # type: ignore[attr-defined]
        for total in acc._shard_sums.values():
            sender.finite &= all_finite(total)
    weight = math.fsum(weight_values(w.weights))
    sender.flush(layout.local_counters(w.participation, w.m, weight, w.status, w.mode))
    sender.wait()
    return layout.read_counters(acc._flat, acc._out)


def _divisor(mode: int, m: int, counts: Counts) -> float:
    if mode == WEIGHTED:
        return math.fsum(counts.weights)
    if mode == DIVIDED:
        return 1
    return m


def _raise_if_any_failed(acc: MicrobatchAccumulator, counts: Counts) -> None:
    rank = get_rank(acc._group)
    bad = {r: STATUS_TEXT.get(s, f"failed (status {s})") for r, s in enumerate(counts.status) if s != OK}
    used = {mo for mo in counts.modes if mo != NONE}
    if len(used) > 1:
        how = "; ".join(f"rank {r} {WEIGHTING[mo]}" for r, mo in enumerate(counts.modes) if mo != NONE)
        bad.setdefault(-1, f"ranks counted their microbatches differently ({how})")
    if not bad:
        return
    w = acc._w
    mine = f" (here: {w.poison})" if w.poison else ""
    w.fail(PEER, f"rank(s) {sorted(r for r in bad if r >= 0)} failed in the window")
    w.open = True  # stays refused on every rank until discard()
    reasons = "; ".join(why if r < 0 else f"rank {r} {why}" for r, why in sorted(bad.items()))
    raise WindowError(f"rank {rank}: finish() refused on every rank: {reasons}{mine}; call discard() on every rank")


def _install(acc: MicrobatchAccumulator, counts: Counts, divisor: float) -> None:
    """Hand out the reduced gradients: views of the buffer, DTensor shards, or FSDP's shards summed and divided."""
    layout, flat, out = acc._layout_now(), acc._flat, acc._out
    external = set(_external(acc))
    for i, t in enumerate(acc._tensors):
        if i in acc._unsharded:
            acc._unsharded[i].grad = None
        if counts.participation[i] == 0:
            t.grad = None  # absent from every microbatch of every rank
        elif i in external:
            t.grad = acc._shard_mean(i, t, divisor)
        elif layout.buckets[layout.slots[i].bucket].kind == "reduce_scatter" and out is not None and acc._fsdp:
            t.grad = acc._fsdp.sharded_grad(t, layout.local_view(out, i))
        elif flat is not None:
            view = layout.full_view(flat, i)
            same = layout.dtype == real_dtype(t.dtype) and t.device == layout.device
            t.grad = view if same else view.to(device=t.device, dtype=t.dtype)


def _external(acc: MicrobatchAccumulator) -> list[int]:
    layout = acc._layout_now()
    return [i for i, s in enumerate(layout.slots) if s.bucket < 0]


def _close_window(acc: MicrobatchAccumulator, ledger: Ledger) -> None:
    only_shards = all(b.kind != "all_reduce" for b in acc._layout_now().buckets)
    acc._reset()  # counters to zero: a second finish() cannot divide the same sums twice
    acc._last = ledger
    if only_shards:
        acc._pools[0].release()  # FSDP2: the unsharded gradient buffer is not kept between windows


def check_layout(acc: AccumulatorCore) -> None:
    """Every rank must lay out the same parameters in the same order, or the sums would mix them.

    Done when the first window opens, before any bucket can leave (on a rank with microbatches, during
    its last backward; on one without, in finish()): so it is the first collective of every rank.
    """
    if acc._layout_checked:
        return
    entries: list[tuple[object, str]] = [
        (n, f"(shape={tuple(t.shape)}, dtype={str(t.dtype).removeprefix('torch.')})")
        for n, t in zip(acc._names, acc._tensors)
    ]
    check_same_on_all_ranks(entries, "accumulated parameters", acc._group)
    acc._layout_checked = True


def local_ledger(
    acc: AccumulatorCore, counts: Counts | None = None, divisor: float | None = None, mode: int | None = None
) -> Ledger:
    """The window's ledger: local counts, and the global ones once ``counts`` came back."""
    w = acc._w
    mode = w.mode if mode is None else mode
    weighted = mode == WEIGHTED
    mine = math.fsum(weight_values(w.weights)) if w.mode == WEIGHTED else None
    names = acc._names
    return Ledger(
        rank=get_rank(acc._group),
        world_size=get_world_size(acc._group),
        microbatches_local=w.m,
        microbatches_global=None if counts is None else sum(counts.per_rank),
        microbatches_per_rank=None if counts is None else tuple(counts.per_rank),
        divisor=divisor,
        participation_local=dict(zip(names, w.participation)),
        participation_global=None if counts is None else dict(zip(names, counts.participation)),
        weighting=WEIGHTING[mode],
        weight_local=mine if mine is not None or not weighted else 0.0,
        weight_per_rank=tuple(counts.weights) if counts is not None and weighted else None,
        weight_global=divisor if weighted else None,
        terms_local=w.terms_local,
        terms=w.terms,
    )


# --- loss terms divided ahead ----------------------------------------------------------------------


def local_terms(local: Mapping[str, object]) -> list[tuple[str, float]]:
    """The terms as ``(name, count)``, each count a finite non-negative number.

    Raises:
        GradaggError: a name that is not a string, or a count that is not a non-negative number.
    """
    items = []
    for name, value in local.items():
        if not isinstance(name, str):
            raise GradaggError(f"divisors(): term names are strings, got {name!r}")
        v = check_weight(value)
        count = float(v) if isinstance(v, float) else float(v.double().item())
        if not math.isfinite(count) or count < 0:
            raise GradaggError(f"divisors(): term {name!r} has count {count}; a count must be finite and non-negative")
        items.append((name, count))
    return items


def count_terms(local: Mapping[str, object], group: Group) -> dict[str, float]:
    """Sum each term's count over the ranks in one float64 all_reduce (exact for whole counts below 2**53).

    Raises:
        CollectiveError: the ranks named different terms (every rank raises).
        GradaggError: a term totals 0 over all ranks (every rank raises).
    """
    items = local_terms(local)
    world, rank = get_world_size(group), get_rank(group)
    names = [n for n, _ in items]
    vec = torch.zeros(len(items) + world, dtype=torch.float64)
    vec[: len(items)] = torch.tensor([c for _, c in items], dtype=torch.float64)
    vec[len(items) + rank] = float(int(hashlib.sha256(repr(names).encode()).hexdigest()[:12], 16))  # < 2**48
    got = all_reduce_sum(vec.to(device_for(group)), group).tolist()
    hashes = got[len(items) :]
    differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if differ:
        raise CollectiveError(
            f"rank {rank}: divisors() got other term names on rank(s) {differ} than on rank 0 (here: {names}); "
            "every rank must name the same terms"
        )
    totals = dict(zip(names, got[: len(items)]))
    for name, total in totals.items():
        if total == 0:
            raise GradaggError(f"divisors(): term {name!r} totals 0 over all {world} ranks: nothing to divide it by")
    return totals
