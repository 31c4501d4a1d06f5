"""The public class, :class:`MicrobatchAccumulator`: a thin shell over one :class:`~.state.State`.

Each method checks its arguments and the window's phase, then calls the function of this package that does
the work, passing the state explicitly (see :mod:`gradagg.torch.accumulate` for the contract and the map).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.options import NonFinite, check_nonfinite
from gradagg.torch import guard
from gradagg.torch.accumulate import attaching, hooks, lifetime, opening, terms, terms_after
from gradagg.torch.accumulate import finish as finishing
from gradagg.torch.accumulate.ledger import DIVIDED, Ledger
from gradagg.torch.accumulate.params import ParamSource
from gradagg.torch.accumulate.state import State, build
from gradagg.torch.accumulate.terms_after import Microbatch
from gradagg.torch.accumulate.window import LATE, RAISED, check_weight
from gradagg.torch.accumulate.wrappers import Choose, chooser, unknown
from gradagg.torch.accumulate.wrappers.fsdp import Mode
from gradagg.torch.accumulate.wrappers.padding import Pad
from gradagg.torch.collectives import Group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")


class MicrobatchAccumulator:
    """Average gradients over the microbatches actually run on all ranks, each counted exactly once.

    Usage, on every rank (the forward may be inside or outside the ``with``)::

        acc = MicrobatchAccumulator(model)            # a module, DDP- or fully_shard-wrapped, or parameters
        for x, y in acc.microbatches(my_batches):      # any number per rank, uneven, zero included
            with acc.microbatch(weight=n_tokens(y)):   # or microbatch() for D = M
                loss_sum(model(x), y).backward()       # the UNSCALED loss
        acc.finish()                                   # grads = sum / D, D counted on all ranks
        optimizer.step(); optimizer.zero_grad()

    ``acc.microbatches(...)`` (or ``microbatch(last=True)``) marks the last microbatch, so that its
    backward already sends the gradient buckets that are complete (overlap, as DDP's); without it
    ``finish()`` sends them all. Either way every rank sends the same collectives in the same order.

    Args:
        module_or_params: a module (its ``named_parameters()``); a ``DistributedDataParallel`` module (kept
            in ``no_sync()`` while attached, its buffers broadcast from rank 0 once per window if DDP syncs them,
            see :mod:`gradagg.torch.accumulate.wrappers.ddp`); a module with ``fully_shard`` applied (FSDP2
            or HSDP, see :mod:`gradagg.torch.accumulate.wrappers.fsdp`); tensors; or ``(name, tensor)`` pairs.
            Parameters without ``requires_grad`` are ignored (one unfrozen later is an error); a tensor
            given twice (tied weights) is one parameter.
        group: a process group, or None for the default one; with no process group at all the accumulator
            works in one process with no communication. A ``DeviceMesh`` here is taken as ``mesh``.
        mesh: a ``DeviceMesh`` with named dims, instead of ``group`` (or with a ``group`` of the same ranks): the
            accumulator counts and reduces over the ranks that differ from this one on its data dims (``dp``,
            ``dp_replicate``, ``dp_shard``, ``cp`` and the flattened ``fsdp``, ``batch``, ``loss``,
            ``dp_shard_cp``, ``dp_cp``: their ranks hold different tokens, a context-parallel rank part of every
            sequence), one group per coordinate on ``tp`` and ``pp`` (their ranks hold the same tokens, never
            counted again). Under FSDP2 the FSDP mesh must span the same ranks. The :class:`Ledger` names the
            dims (``counted_over``, ``reduced_over``). See :mod:`gradagg.torch.accumulate.meshes`.
        nonfinite: ``"propagate"`` (default): NaN and Inf flow through the sum, identically on every rank;
            ``"raise"``: :meth:`finish` raises :class:`NonFiniteGradientError` on every rank, naming the
            ranks whose gradients were non-finite.
        fsdp: under FSDP2, ``"shards"`` (default; ``"every_microbatch"``, its former name, too): sharded
            gradients only, FSDP reducing each microbatch, uneven counts padded (see :mod:`.wrappers.padding`); or
            ``"window"``: unsharded parameters and gradients held over the window, no padding. See
            :mod:`gradagg.torch.accumulate.wrappers.fsdp`.
        pad: the shards form's padding microbatch, for a rank that ran out while others still run one:
            ``fn()`` (a forward on a small batch, returning its loss; its gradients are dropped), ``"replay"``
            (default: every forward of this rank's last microbatch runs again, with its inputs), or None (uneven
            counts then raise GradaggError on every rank). Used by the shards forms (FSDP2's, FSDP1's) only.
        bucket_mb: the size of a gradient bucket, one collective each (DDP's default: 25).
        terms: names of loss terms, each divided by its own count over the window on all ranks, counted as the
            window runs (see :mod:`.terms_after`): every backward is then ``mb.backward(term, loss, count=...)``,
            and a count may also come later, by :meth:`count`. The same names on every rank.

    Raises:
        GradaggError: an invalid option; a ``mesh`` whose dims are unnamed or named otherwise than above (each
            named, with how to name it), or that disagrees with ``group`` (both named); an FSDP2 mesh over other
            ranks than the accumulator's group (both named); an unsupported FSDP2 layout; DTensor parameters
            outside ``fully_shard``; ``DDP(static_graph=True)``; a parameter on the meta device; a parameter
            another live accumulator holds (naming both: ``close()`` or drop the first; see :mod:`.lifetime`); bare
            tensors that cannot be told apart across ranks (every rank); ``terms`` that are not distinct names, or
            with FSDP2's shards form, FSDP1 or DDP's ``parameters_to_ignore`` (see :mod:`.terms_after`).
        CollectiveError: the ranks' parameter lists, or their ``terms``, differ (compared with one small
            ``all_gather_object`` at construction, which every rank of the group runs: build accumulators in the
            same order on every rank).

    >>> lin = torch.nn.Linear(1, 1, bias=False)
    >>> acc = MicrobatchAccumulator(lin)
    >>> for x in (1.0, 3.0):
    ...     with acc.microbatch():
    ...         lin(torch.tensor([[x]])).sum().backward()
    >>> _ = acc.finish()
    >>> lin.weight.grad  # (1 + 3) / M, M = 2
    tensor([[2.]])
    """

    def __init__(
        self,
        module_or_params: ParamSource,
        *,
        group: Group = None,
        mesh: DeviceMesh | None = None,
        nonfinite: NonFinite = "propagate",
        fsdp: Mode = "shards",
        bucket_mb: float = 25.0,
        pad: Pad = "replay",
        terms: Iterable[str] | None = None,
    ) -> None:
        choose = self._chooser(fsdp, pad)  # plain, DDP or FSDP2's form: see gradagg.torch.accumulate.wrappers
        self._state = build(module_or_params, group, check_nonfinite(nonfinite), bucket_mb, mesh, choose)
        try:
            self._state.terms = terms_after.check_names(terms, self._state)
        except BaseException:
            lifetime.release(self._state)  # DDP and FSDP2 given their own synchronisation back
            raise
        # dropped without close(): released as close() would (nothing the state holds refers back to self)
        self._release = weakref.finalize(self, lifetime.release, self._state)
        self._release.atexit = False
        opening.install(self._state)
        unknown.watch(self._state)  # a wrapper it was not given, met at the first forward through it

    def _chooser(self, fsdp: Mode, pad: Pad) -> Choose:
        """The wrapper's chooser (see :mod:`gradagg.torch.accumulate.wrappers`); a subclass for another wrapper
        (DeepSpeed's, :mod:`gradagg.integrations.deepspeed`) returns its own."""
        return chooser(fsdp, pad)

    # --- the window ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def microbatch(self, weight: object = None, *, last: bool = False) -> Iterator[Microbatch]:
        """One microbatch: run its backward (the unscaled loss) inside the ``with``.

        With ``terms=``, run each loss term's backward as ``mb.backward(term, loss, count=...)`` on the
        :class:`~.terms_after.Microbatch` it yields (``with acc.microbatch() as mb:``); a plain backward is then
        refused.

        A microbatch that raises after a gradient was accumulated poisons the window (:meth:`finish` then
        raises on every rank until :meth:`discard`); one that raises before touching any gradient (e.g.
        in the forward) is not counted.

        A ``.grad`` set by hand inside the ``with`` counts in this microbatch, as a backward's gradient would
        (added to it, if a backward reached the parameter too); one set between microbatches, after the last one,
        or on an FSDP2 shard counts in none: :meth:`finish` refuses on every rank.

        Args:
            weight: what this microbatch counts for in the divisor (e.g. its number of valid tokens): a
                non-negative number or 0-dim tensor. Weight every microbatch of the window or none; without
                weights D = M. Not with ``terms=`` (each term has its count).
            last: this is the rank's last microbatch of the window: complete buckets leave during its
                backward. Set for you by :meth:`microbatches`.

        Returns:
            A context manager yielding the microbatch's :class:`~.terms_after.Microbatch` (ignore it without terms).

        Raises:
            WindowError: nested microbatches (a non-zero gradient present as the window opens is refused by
                :meth:`finish`, on every rank).
            GradaggError: a weight that is not a real number or 0-dim real tensor.
        """
        st = self._open_state()
        if st.window.in_microbatch:
            raise WindowError("microbatch() entered inside another microbatch(); microbatches do not nest")
        guard.unveil(st)  # autograd accumulates into .grad: None again until the microbatch ends (see torch.held)
        value = None if weight is None else check_weight(weight)
        lookahead, st.window.next_last = st.window.next_last, None
        last = last or bool(lookahead)
        if not st.window.open:
            opening.open_window(st)
        w = st.window
        early = st.wrapper.before_microbatch(st, last, lookahead)  # FSDP2 shards: the round agreed with the ranks
        hooks.refuse_hand_set(st, f"before microbatch {w.m}")
        if w.last_done:
            w.fail(LATE, f"microbatch {w.m} runs after the microbatch marked last")
        if st.terms:
            terms_after.enter(st, value)
        else:
            w.note_weighting(value)
        # with terms, no bucket leaves early: a term's divisor is known only when every count is in
        w.in_microbatch, w.seen, w.in_last = True, set(), early and not st.terms
        w.running = value
        try:
            yield Microbatch(st, w.m)
            if w.in_microbatch:  # (not ended early by _end_microbatch)
                hooks.take_hand_set(st)
        except BaseException as exc:
            if w.seen and w.in_microbatch:
                w.fail(RAISED, f"microbatch {w.m} raised {type(exc).__name__}: {exc} after gradients were accumulated")
            told = st.wrapper.explained(st, exc)  # FSDP2 shards: a collective broken by a padding rank, named
            if told is not exc:
                raise told from exc
            raise
        else:
            if w.in_microbatch:
                w.complete(value)
                w.last_done = w.last_done or last
        finally:
            w.in_microbatch = w.in_last = False
            st.wrapper.after_microbatch(st)
            guard.veil(st)  # between microbatches a read of a held .grad refuses, whatever name it comes by

    def _end_microbatch(self) -> None:
        """Count the running microbatch now, its backward done, so that :meth:`finish` may run inside its ``with``
        (Accelerate's DeepSpeed backward steps the engine there, see :mod:`gradagg.integrations.deepspeed`); the
        ``with`` then counts nothing more."""
        st = self._state
        w = st.window
        hooks.take_hand_set(st)
        w.complete(w.running)
        w.in_microbatch = w.in_last = False

    def microbatches(self, items: Iterable[T]) -> Iterator[T]:
        """Yield ``items`` with one item of look-ahead, so that the last one's microbatch is marked ``last``.

        Args:
            items: this rank's microbatches (any number, zero included).

        Returns:
            An iterator over ``items``; run each inside :meth:`microbatch`.

        >>> acc = MicrobatchAccumulator([torch.zeros(1, requires_grad=True)])
        >>> list(acc.microbatches("ab"))
        ['a', 'b']
        """
        st = self._open_state()
        own = st.wrapper.microbatches(st, items)  # FSDP2's shards form: one agreed round per item, then padding
        return own if own is not None else self._lookahead(items)

    def _lookahead(self, items: Iterable[T]) -> Iterator[T]:
        it = iter(items)
        try:
            upcoming = next(it)
        except StopIteration:
            return
        try:
            while True:
                current = upcoming
                try:
                    upcoming, last = next(it), False
                except StopIteration:
                    last = True
                self._state.window.next_last = last
                yield current
                # the item's microbatch() took the flag; an item skipped (``continue``) leaves it for nobody
                self._state.window.next_last = None
                if last:
                    return
        finally:  # the loop left early (``break``, an exception): the flag it set marks nothing
            self._state.window.next_last = None

    def divisors(self, local: Mapping[str, object]) -> dict[str, float]:
        """Global divisors of the window's loss terms, counted ahead: one small all_reduce before any backward.

        For a loss with several terms normalised differently (cross-entropy by tokens, an auxiliary loss by
        microbatches), give this rank's counts of the window, divide each term by its global total, and
        back-propagate the sum; ``finish()`` then only sums (D = 1) and the ledger records each term's
        divisor. Call it on every rank, with the same names, before the window's first microbatch.

        Args:
            local: term name -> this rank's count for the window (non-negative number or 0-dim tensor).

        Returns:
            Term name -> its total over all ranks.

        Raises:
            WindowError: called after the window's first microbatch, or twice in a window.
            GradaggError: a count that is not a non-negative number; a term totalling 0 (every rank); an accumulator
                built with ``terms=`` (its terms are counted as the window runs: see :meth:`count`).
            CollectiveError: ranks gave different names (every rank, naming them).

        >>> acc = MicrobatchAccumulator([torch.zeros(1, requires_grad=True)])
        >>> acc.divisors({"tokens": 7, "microbatches": 2})
        {'tokens': 7.0, 'microbatches': 2.0}
        """
        if self._open_state().terms:
            raise GradaggError(
                "divisors() on an accumulator built with terms=: its loss terms are counted as the window runs "
                "(mb.backward(term, loss, count=...), acc.count(term, n)); use one way or the other"
            )
        w = self._state.window
        if w.open or w.terms is not None:
            raise WindowError("divisors() must come once per window, before its first microbatch")
        totals = terms.count_terms(local, self._state.group)
        w.terms_local, w.terms, w.mode = dict(terms.local_terms(local)), totals, DIVIDED
        return dict(totals)

    def count(self, term: str, n: object) -> None:
        """Add ``n`` to this rank's count of loss term ``term`` in the current window (an accumulator with ``terms=``).

        Any time before :meth:`finish`, inside a microbatch or not, any number of times: e.g. after the last
        microbatch, the tokens that survived a filter inside the loss. Local (no collective).

        Args:
            term: one of the accumulator's ``terms``.
            n: a non-negative number or 0-dim tensor (a tensor's value is taken now, without a host sync).

        Raises:
            GradaggError: an accumulator without ``terms=``; ``n`` not a real number or 0-dim tensor. An unknown
                ``term``, or a negative, NaN or infinite ``n``, is refused by :meth:`finish` on every rank.

        >>> w = torch.ones(1, requires_grad=True)
        >>> acc = MicrobatchAccumulator([("w", w)], terms=("nll",))
        >>> for k in (1.0, 2.0):
        ...     with acc.microbatch() as mb:
        ...         mb.backward("nll", k * w.sum())
        >>> acc.count("nll", 6)     # known only now
        >>> acc.finish().terms, w.grad
        ({'nll': 6.0}, tensor([0.5000]))
        """
        terms_after.count(self._open_state(), term, n)

    def finish(self) -> Ledger:
        """Close the window: every ``.grad`` becomes the sum over all microbatches of all ranks / D.

        One collective per gradient bucket (one for a model under ``bucket_mb``), the counters travelling
        in the last; none without a process group. Every rank must finish the same accumulator: its identity
        travels with the counters. The next :meth:`microbatch` opens a new window and requires the gradients
        to be None again.

        Returns:
            The :class:`Ledger` of the window.

        Raises:
            WindowError: on every rank, when the ranks finish different accumulators (another order on
                each); when any rank's window is poisoned (a microbatch raised
                mid-backward, a backward outside ``microbatch()``, an invalid weight, weighted and
                unweighted microbatches mixed, a parameter unfrozen after construction, a ``.grad`` set by hand
                outside a microbatch) or had non-zero gradients before it opened (exact zeros, a
                ``zero_grad(set_to_none=False)``'s leftovers, count as absent); when M = 0, or the total weight is 0 or
                beyond what the gradients' dtype can be divided by; when called inside a microbatch; with ``terms=``,
                the refusals listed in :mod:`.terms_after` (a backward outside ``mb.backward()``, a term counted 0
                with a non-zero gradient, ...).
            NonFiniteGradientError: on every rank, with ``nonfinite="raise"`` and a NaN or Inf gradient.
            CollectiveError: a collective failed or timed out.
        """
        st = self._open_state()
        if st.window.in_microbatch:
            raise WindowError("finish() called inside microbatch(); finish after the last microbatch's with-block")
        guard.unveil(st)
        return finishing.finish(st)

    def discard(self) -> None:
        """Drop the window: every gradient back to None, counters to zero. Local; call it on every rank.

        >>> acc = MicrobatchAccumulator([torch.zeros(1, requires_grad=True)])
        >>> acc.discard(); acc.ledger.microbatches_local
        0
        """
        guard.unveil(self._state)
        finishing.discard(self._state)

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Run :meth:`finish` before ``optimizer`` steps, for loops a framework owns (see :mod:`.attaching`).

        Args:
            optimizer: any ``torch.optim.Optimizer``.

        Returns:
            A handle (``.remove()`` detaches it; :meth:`close` does too).

        Raises:
            GradaggError: another optimizer over some of the same parameters is attached already (each window's
                gradient would be stepped twice: ``remove()`` the first's handle); an Accelerate optimizer with
                ``gradient_accumulation_steps`` > 1 (``accelerator.backward`` divides the summed loss: use
                ``gradagg.integrations.accelerate.exact``).
        """
        finish = weakref.WeakMethod(self.finish)  # the hooks must not keep the accumulator alive

        def finish_if_alive() -> object:
            bound = finish()
            return None if bound is None else bound()

        return attaching.attach(self._state, optimizer, finish_if_alive, divides=not self._undoes_division)

    # Accelerate's accelerator.backward divides by gradient_accumulation_steps; a subclass that sets it to 1 inside
    # each microbatch (gradagg.integrations.accelerate's) says so here, and attach() then accepts such optimizers.
    _undoes_division = False

    def close(self) -> None:
        """Remove every hook; give DDP and FSDP2 their own synchronisation back. The accumulator is then unusable.

        An accumulator dropped without ``close()`` is closed when its last reference goes (see :mod:`.lifetime`)."""
        self._release()

    @property
    def ledger(self) -> Ledger:
        """The current window's counts (global counts after :meth:`finish`), or the last finished window's."""
        st = self._state
        if st.last is not None and not st.window.open:
            return st.last
        return finishing.local_ledger(st)

    @property
    def state(self) -> State:
        """The accumulator's :class:`~gradagg.torch.accumulate.state.State`, for tools, tests and integrations to
        read (is a window open? its layout, its buckets); changing it by hand is unsupported. Holding it does not
        keep the accumulator alive: dropped, the accumulator closes its state."""
        return self._state

    def report(self) -> str:
        """The ledger as readable text (see :meth:`Ledger.report`)."""
        return self.ledger.report()

    def _open_state(self) -> State:
        if self._state.superseded is not None:
            raise WindowError(
                f"{self._state.label()} was closed by a newer accumulator over its parameters, built at "
                f"{self._state.superseded} while this one held no window; use the newer one"
            )
        if self._state.closed:
            raise WindowError("this accumulator was closed (its hooks are gone); create a new one")
        return self._state


__all__ = ["MicrobatchAccumulator"]
