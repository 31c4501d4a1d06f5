"""The end of an accumulation window: send, check on every rank, divide once, hand out the gradients.

The one long sequence of the accumulator; each step is a small function of the :class:`~.state.State`.
Every decision below is taken from the *reduced* counters, which are the same on every rank, so every
rank raises, or succeeds, together.
"""

from __future__ import annotations

import weakref

from gradagg.errors import NonFiniteGradientError, WindowError
from gradagg.torch.accumulate import hooks, opening, stale, terms_after
from gradagg.torch.accumulate.counting import divisor_problem
from gradagg.torch.accumulate.flat import Counts, real_dtype
from gradagg.torch.accumulate.ledger import DIVIDED, NONE, TERMS, WEIGHTED, WEIGHTING, Ledger
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.window import (
    OK,
    PEER,
    STATUS_TEXT,
    Window,
    weight_sum,
)


def finish(state: State) -> Ledger:
    """:meth:`MicrobatchAccumulator.finish` after its argument checks (see there)."""
    _prepare(state)
    counts = _exchange(state)
    _refuse_other_accumulators(state, counts)
    state.wrapper.after_exchange(state)  # every rank is here, whatever its count (DDP: the buffers' broadcast)
    _raise_if_any_failed(state, counts)
    m = sum(counts.per_rank)
    if m == 0:
        discard(state)
        raise WindowError("finish() with no microbatch run on any rank (M = 0): there is no mean to take")
    mode = max(counts.modes)
    divisor = _divisor(state, mode, m, counts)
    _install(state, counts, divisor)
    state.wrapper.close(state)
    ledger = local_ledger(state, counts, divisor, mode, state.window.total)
    _close_window(state, ledger)
    if counts.nonfinite:  # gradients are floating or complex: isfinite is defined on them
        names = [n for n, t in zip(state.names, state.tensors) if t.grad is not None and not t.grad.isfinite().all()]
        raise NonFiniteGradientError(
            f"rank {state.rank}: non-finite gradients on rank(s) {counts.nonfinite}, in {names} after the "
            "reduction; every rank raises, with the same reduced (non-finite) gradients in .grad: zero them and skip "
            "this step"
        )
    return ledger


def discard(state: State) -> None:
    """Drop the window: every gradient back to None, counters to zero (see ``MicrobatchAccumulator.discard``)."""
    for t in [*state.tensors, *state.wrapper.held().values()]:
        t.grad = None
    state.wrapper.discard(state)
    _new_window(state)


def _prepare(state: State) -> None:
    """Open the window of a rank that ran no microbatch; record what only now can be checked."""
    w = state.window
    ran = w.open
    if ran:  # before any padding round, whose backward would drop a .grad set by hand
        hooks.refuse_hand_set(state, "after the window's last microbatch")
        opening.check_params(state)
    else:
        opening.open_window(state, empty=True)  # a stale gradient fails the window there
    w.settle_weights()  # a weight that cannot count fails the window here (read once: the wrapper reads the total)
    state.wrapper.prepare(state, ran)  # FSDP2 shards: a rank with none pads while the others still run theirs
    if state.terms:  # every rank: each term counted over the ranks, then divided into the window's buffer
        terms_after.settle(state)


def _exchange(state: State) -> Counts:
    """Send every bucket that has not left yet, the counters with the last; wait; read the counters."""
    w, layout, sender = state.window, state.layout(), state.window.sender
    if sender is None or w.flat is None:
        raise RuntimeError("internal error: an open window without its buffer")
    sender.flush(layout.local_counters(w.participation, w.m, w.weight_total(), w.status, w.mode, state.identity))
    sender.wait()
    return layout.read_counters(w.flat, w.out)


def _refuse_other_accumulators(state: State, counts: Counts) -> None:
    """Every rank must have finished this same accumulator: the identities that rode with the counters agree.

    Raises:
        WindowError: on every rank (each reads every rank's identity), before anything is installed or broadcast;
            the window stays refused until ``discard()``, as the gradients summed were another accumulator's.
    """
    if len(set(counts.identities)) <= 1:
        return
    w = state.window
    w.fail(PEER, "the ranks finished different accumulators in one collective")
    w.open = True
    names = "; ".join(f"rank {r}: accumulator #{s} (layout {f:08x})" for r, (s, f) in enumerate(counts.identities))
    raise WindowError(
        f"rank {state.rank}: finish() of {state.label()} met another accumulator on another rank ({names}): "
        "the ranks finished their accumulators in another order, so the sums mixed them; nothing was installed",
        remedy="discard() every accumulator of the window on every rank, then build and finish them in the same "
        "order on every rank",
    )


def _divisor(state: State, mode: int, m: int, counts: Counts) -> float:
    """D from the reduced counters (the same on every rank): M, the total weight, or 1 (terms divided ahead, or each
    by its own count before the exchange).

    Raises:
        WindowError: a total weight of 0, beyond float64, or outside what the buffer's dtype can divide by
            (a float32 buffer cannot hold D = 1e39: every gradient would become 0 or NaN).
    """
    if mode in (DIVIDED, TERMS):
        return 1
    if mode != WEIGHTED:
        return m
    divisor = weight_sum(counts.weights)
    why = None
    if divisor == 0:
        why = f"the total weight of the window is 0 over {m} microbatches: there is no mean to take"
    elif (problem := divisor_problem(divisor, state.layout().dtype)) is not None:
        why = f"the total weight of the window, {divisor!r}, {problem}"
    if why is not None:
        discard(state)
        raise WindowError(f"{why} (per rank: {counts.weights})")
    return divisor


def _raise_if_any_failed(state: State, counts: Counts) -> None:
    rank = state.rank
    bad = {r: STATUS_TEXT.get(s, f"failed (status {s})") for r, s in enumerate(counts.status) if s != OK}
    used = {mo for mo in counts.modes if mo != NONE}
    if len(used) > 1:
        how = "; ".join(f"rank {r} {WEIGHTING[mo]}" for r, mo in enumerate(counts.modes) if mo != NONE)
        bad.setdefault(-1, f"ranks counted their microbatches differently ({how})")
    if not bad:
        return
    w = state.window
    mine = f" (here: {w.poison})" if w.poison else ""
    w.fail(PEER, f"rank(s) {sorted(r for r in bad if r >= 0)} failed in the window")
    w.open = True  # stays refused on every rank until discard()
    reasons = "; ".join(why if r < 0 else f"rank {r} {why}" for r, why in sorted(bad.items()))
    raise WindowError(f"rank {rank}: finish() refused on every rank: {reasons}{mine}",
                      remedy="call discard() on every rank")


def _install(state: State, counts: Counts, divisor: float) -> None:
    """Divide once; hand out the reduced gradients: views of the buffer, the wrapper's for sharded and external
    parameters."""
    layout, w = state.layout(), state.window
    if divisor != 1 and w.flat is not None:
        layout.divide(w.flat, w.out, divisor)
    for i, t in enumerate(state.tensors):
        present = counts.participation[i] > 0
        if i in state.sharded or i in state.external:
            state.wrapper.hand_out(state, i, t, divisor, present)
        elif not present:
            t.grad = None  # absent from every microbatch of every rank
        elif w.flat is not None:
            view = layout.full_view(w.flat, i)
            same = layout.dtype == real_dtype(t.dtype) and t.device == layout.device
            t.grad = view if same else view.to(device=t.device, dtype=t.dtype)
    # what was handed out, to tell a second finish() apart from other gradients left before a window
    state.handed = {i: (weakref.ref(g), stale.version(g))
                    for i, t in enumerate(state.tensors) if (g := t.grad) is not None}


def _new_window(state: State) -> None:
    """Forget the window: counters to zero, buffers dropped (a second finish() cannot divide twice)."""
    state.window = Window(len(state.tensors))


def _close_window(state: State, ledger: Ledger) -> None:
    only_shards = all(b.kind != "all_reduce" for b in state.layout().buckets)
    _new_window(state)  # counters to zero: a second finish() cannot divide the same sums twice
    state.last = ledger
    state.finished += 1
    if only_shards:
        state.pools[0].release()  # FSDP2: the unsharded gradient buffer is not kept between windows


def local_ledger(
    state: State, counts: Counts | None = None, divisor: float | None = None, mode: int | None = None,
    total: float | None = None,
) -> Ledger:
    """The window's ledger: local counts, and the global ones once ``counts`` came back (``total``: this rank's
    total weight, when settled)."""
    w: Window = state.window
    mode = w.mode if mode is None else mode
    weighted = mode == WEIGHTED
    mine = None if w.mode != WEIGHTED else total if total is not None else w.weight_total()
    names = state.names
    return Ledger(
        rank=state.rank,
        world_size=state.world,
        span=state.span,
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
        rank_local=tuple(n for n, _ in state.params.local),
        rank_local_divisor=w.local_divisor() if counts is not None and state.params.local else None,
    )


__all__ = ["discard", "finish", "local_ledger"]
