"""Exact steps under torchft: each committed step is the token mean of exactly the data that took part.

torchft (pytorch/torchft) trains through failures: a quorum of replica groups per step, a fault-tolerant
all-reduce through its ``Manager``, ``should_commit()`` to drop a step that lost a member, healing groups that sit a
step out. Its ``Manager.allreduce`` averages by **the number of participating groups** (the sum divided by
``num_participants()``): with uneven tokens per group the step is a mean of group means, not the token mean. Here
the window's gradient SUM and its COUNTS travel in torchft's all-reduce as a SUM, and the step divides by the counts
of the groups that really contributed::

    manager = torchft.Manager(pg=ProcessGroupGloo(), ...)          # as torchft documents it
    acc = MicrobatchAccumulator(model, group=my_replica_group)      # inside the group: as without torchft
    ft = exact(manager, acc)
    for step in ...:
        manager.start_quorum()                                       # torchft's OptimizerWrapper.zero_grad does this
        for key, batch in ft.microbatches(my_batches):               # (key, batch) pairs: key names the samples
            with ft.microbatch(weight=n_tokens(batch), key=key):
                loss_sum(model, batch).backward()                    # the UNSCALED loss
        report = ft.finish()                                         # calls manager.should_commit() itself
        if report.committed:
            optimizer.step()                                         # the plain optimizer, not OptimizerWrapper
        optimizer.zero_grad()
        queue.extendleft(reversed(report.skipped))                   # re-feed what no committed step applied

What :meth:`ReplicaGroups.finish` does, on every rank of every group:

1. the group's window closes as it does without torchft (``acc.finish()``: the group's sum / its divisor ``D_g``,
   counted over the group's ranks); a group that ran no microbatch (or weighed 0) discards instead and sends zeros;
2. the gradients times ``D_g`` (the group's SUM again, zeros where a parameter had none) and, in float64, the
   group's counts (tokens and microbatches in its quorum slot, its weighting, each parameter's participation) go
   through ``manager.allreduce(..., reduce_op=SUM)``: torchft zeroes both for a group that does not participate
   (healing under its async quorum), so such a group adds nothing to either;
3. the gradients are divided by the summed counts (the total weight; the total microbatches without weights);
   a parameter no group gave a gradient stays None;
4. ``manager.should_commit()``: False when torchft saw an error (a group died mid-step, an all-reduce failed),
   too few replicas, or nothing to divide by (reported to the manager first).

**A failed step is retried by the survivors** (``retries=1``, the default): a new quorum at the same step (a failed
commit does not move torchft's step; the dead group is left out) and stages 2 to 4 again, from the group's own
gradients (``acc.finish()``'s, left untouched until a step commits: the all-reduced buffer may be corrupted). The
step committed is then the token mean over the surviving groups' windows; only the dead group's are lost. A window
is *stale* when the retry's quorum healed the group (its step moved: the others committed the step; or a heal at
the same step, as ``init_sync`` does at step 0, changed its parameters): it is sent as zeros and reported skipped,
and the group commits the others' step with them, never two steps for one. Every window carries a random token
in its counts, and each group keeps the tokens of the steps it committed in the state torchft hands a healing
group (``register_state_dict_fn("gradagg", ...)``): a group whose own commit failed after its data reached the
others learns at its retry's heal that they committed it, and reports it applied there, not skipped (re-fed, it
would count twice); where that was the last attempt, one more quorum (sending nothing) heals it (see
``ReplicaGroups._resolve``). When every attempt fails the gradients are dropped (None) and the optimizer must not step;
``retries=0`` is torchft's own behaviour (it cannot tell a window the others committed from one nobody did).

The :class:`StepReport` says what happened: committed or not, why not, this group's tokens and microbatches, the
summed counts (the divisor), ``attempts``, ``applied_in`` (the committed step holding this window) and ``skipped``:
the keys of this rank's microbatches that no committed step applied (all of them in a dropped step; all of them for
a healing or stale group, whose data sat the step out). Re-feed those, or record them as skipped: either way every
sample is in exactly one committed step or reported. A group that fails locally calls :meth:`ReplicaGroups.abandon`
to report its own window before leaving.

Every group must have as many ranks: torchft's all-reduce pairs rank r of each group, and a rank of a larger group
has no partner. Each group's size travels in the counts and the group's ranks agree on what they read, so groups of
different sizes are refused on every rank (a :class:`~gradagg.errors.CollectiveError` naming both sizes); a rank lost
inside a group makes the group's own all-reduce fail, and its other ranks refuse the step (torchft cannot keep a
group that lost a rank: they must leave, and the others commit without the group).

Not covered: ``terms=`` accumulators (each loss term divided by its own count cannot be re-divided: refused) and
``divisors()`` ("divided ahead": refused on every group); HSDP inside a group is untested (FSDP2 is tested).
Memory: one gradient-sized buffer (the flat SUM that travels), kept between windows, and none more for the retry; a
committed step's gradients are views of it, dropped (``zero_grad()``) before the next window as the accumulator
requires.
This module imports nothing of torchft: the manager is the caller's.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from gradagg.errors import CollectiveError, GradaggError, first_line
from gradagg.integrations import _torchft_sums as sums
from gradagg.integrations._torchft_report import StepReport
from gradagg.integrations._torchft_sums import NONE, UNWEIGHTED, WEIGHTED
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.accumulate.terms_after import Microbatch

T = TypeVar("T")

_MODES = {"weighted": WEIGHTED, "unweighted": UNWEIGHTED, "none": NONE}


class Manager(Protocol):
    """What this module uses of ``torchft.Manager`` (its public methods, nothing else)."""

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = ..., reduce_op: Any = ...) -> Any: ...
    def should_commit(self) -> bool: ...
    def num_participants(self) -> int: ...
    def participating_rank(self) -> int | None: ...
    def is_participating(self) -> bool: ...
    def current_step(self) -> int: ...
    def errored(self) -> Any: ...
    def report_error(self, e: Exception) -> None: ...
    def start_quorum(self) -> None: ...


@dataclass
class _Group:
    """What this group counted in the window (the same on each of its ranks)."""

    microbatches: int
    weight: float
    mode: int
    divisor: float  # D_g: what acc.finish() divided by (1 when it did not run)
    participation: list[float] = field(default_factory=list)
    token: int = 0  # names this window of this group in the step's sums (0: it sends nothing)


@dataclass
class _Attempt:
    """One pass of the window through torchft: the quorum it ran in, what it sent, what came back."""

    step: int
    slots: int
    sent: bool  # this group's window went into the sums (not stale, not healing)
    total: sums.Totals | None  # None: the all-reduce failed
    failure: str = ""  # why it did not commit ("" when it did)


_KEEP_STEPS = 64
"""Steps whose committed window tokens a group remembers (and hands to a group that heals from it): a group behind by
more than this many steps cannot have had its window committed by the others (every step after it was a new quorum)."""


class ReplicaGroups:
    """A :class:`~gradagg.torch.MicrobatchAccumulator` inside a replica group, its windows summed across groups
    through torchft. Made by :func:`exact`; see the module's docstring for the loop."""

    def __init__(self, manager: Manager, accumulator: MicrobatchAccumulator, group: str, retries: int = 1) -> None:
        if accumulator.state.terms:
            raise GradaggError(
                f"exact(manager, acc): acc has terms={list(accumulator.state.terms)}, each term divided by its own "
                "count; a gradient so divided cannot be re-divided across replica groups: build it without terms="
            )
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise GradaggError(f"exact(manager, acc, retries={retries!r}): retries is a count of retried "
                               "reductions per step, an int >= 0 (0: torchft's own behaviour, the step dropped)")
        self.manager, self.accumulator, self.group, self.retries = manager, accumulator, group, retries
        self.history: list[StepReport] = []
        self._keys: list[Hashable] = []
        self._flats: sums.Flats | None = None  # the window's SUM, its buffers kept for the next window
        self._committed: dict[int, frozenset[int]] = {}  # step -> the window tokens it holds
        self._healed = False  # a heal loaded a peer's state since the window closed
        register = getattr(manager, "register_state_dict_fn", None)
        if register is not None:  # a heal then brings the peer's record of committed windows
            try:
                register("gradagg", self._load_record, self._record)
            except AssertionError:  # torchft asserts on a key registered twice
                raise GradaggError("exact(manager, acc): this manager already has a gradagg ReplicaGroups; "
                                   "make one exact() per manager") from None

    @contextlib.contextmanager
    def microbatch(self, weight: object = None, *, key: Hashable = None, last: bool = False) -> Iterator[Microbatch]:
        """One microbatch, as :meth:`MicrobatchAccumulator.microbatch`; ``key`` names its samples in the reports.

        Args:
            weight: its weight (tokens), as for the accumulator.
            key: any hashable naming the microbatch's samples; recorded once the microbatch completes.
            last: as for the accumulator (:meth:`microbatches` sets it).

        Returns:
            The accumulator's microbatch context.
        """
        with self.accumulator.microbatch(weight, last=last) as mb:
            yield mb
        self._keys.append(key)

    def microbatches(self, items: Iterable[T]) -> Iterator[T]:
        """``items`` with the last marked, as :meth:`MicrobatchAccumulator.microbatches`.

        Args:
            items: this rank's microbatches for the window.

        Returns:
            An iterator over them.
        """
        return self.accumulator.microbatches(items)

    def finish(self) -> StepReport:
        """Close the window across the replica groups; see the module's docstring for the stages and the retry.

        Returns:
            The :class:`StepReport`; the gradients are the step's exact mean when ``committed``, None otherwise.

        Raises:
            WindowError: on every group, when the groups weighted differently (some with weights, some without) or
                one divided ahead (``divisors()``); inside a microbatch; the accumulator's own refusals.
        """
        keys, self._keys = tuple(self._keys), []
        mine = self._close_group()
        self._healed = False
        # a group healing under the async quorum computed its window on parameters it is about to replace, and one
        # that ran nothing has nothing to send: neither window can count, in this attempt or a retry
        usable = mine.microbatches > 0
        before: torch.Tensor | None = None  # the parameters' fingerprint, taken before the first retry's quorum
        first_step = -1
        for n in range(1 + self.retries):
            if n > 0:
                before = _fingerprint(self.accumulator.state.tensors) if before is None else before
                self.manager.start_quorum()  # a failed commit kept the step: the new quorum is at the same step
            slots = self.manager.num_participants()  # waits for the quorum: a healing group's step is set by then
            step = self.manager.current_step()
            if n == 0:
                first_step = step
            elif usable:
                usable = not self._stale(first_step, step, before)
            usable = usable and self.manager.is_participating()
            attempt = self._reduce(mine, slots, step, usable)
            if not attempt.failure:
                return self._commit(mine, keys, attempt, first_step, n + 1)
        if self.retries and attempt.sent:
            return self._resolve(mine, keys, first_step, 2 + self.retries)
        return self._drop(mine, keys, attempt, first_step, 1 + self.retries)

    def _resolve(self, mine: _Group, keys: tuple[Hashable, ...], first_step: int, attempts: int) -> StepReport:
        """The last attempt failed after this group's window went out: the others may have committed it (their
        ``should_commit()`` is their own). One more quorum, sending nothing, tells: a group that committed it is a
        step ahead, so the quorum heals this one and brings their record of committed windows (the window is then
        applied there, not skipped: re-fed, it would count twice); at the same step no group committed it. This
        group then takes part in that quorum's step with zeros, as a stale retry does."""
        self.manager.start_quorum()
        slots = self.manager.num_participants()
        attempt = self._reduce(mine, slots, self.manager.current_step(), False)
        if not attempt.failure:
            why = None if attempt.step != first_step else (
                f"its last attempt failed after the window went out, and one more quorum found no group had committed "
                f"step {first_step} with it")
            return self._commit(mine, keys, attempt, first_step, attempts, why)
        return self._drop(mine, keys, attempt, first_step, attempts)

    def abandon(self, why: str) -> StepReport:
        """Drop this rank's window locally (a group failing on its own, before it leaves) and report it skipped.

        Args:
            why: the reason, for the report.

        Returns:
            The :class:`StepReport` of the dropped window.

        >>> from types import SimpleNamespace
        >>> lin = torch.nn.Linear(1, 1)
        >>> ft = ReplicaGroups(SimpleNamespace(current_step=lambda: 4), MicrobatchAccumulator(lin), "g0")
        >>> with ft.microbatch(key="b0"):
        ...     lin(torch.ones(1, 1)).sum().backward()
        >>> ft.abandon("injected failure").text()
        'step 4, group g0: NOT applied (injected failure): 1 microbatches skipped: keys b0'
        """
        keys, self._keys = tuple(self._keys), []
        st = self.accumulator.state
        m = self.accumulator.ledger.microbatches_local if st.window.open else 0  # this rank's: the group's is unknown
        self._discard()
        return self._keep(StepReport(step=self.manager.current_step(), group=self.group, committed=False,
                                     participating=False, group_microbatches=m, group_weight=None, keys=keys,
                                     skipped=keys, reason=why))

    @property
    def skipped(self) -> list[Hashable]:
        """Every key of this rank that no committed step applied, over :attr:`history`, in order."""
        return [k for r in self.history for k in r.skipped]

    # --- the stages -------------------------------------------------------------------------------------------

    def _close_group(self) -> _Group:
        """Stage 1: the group's own window, closed by the accumulator (or discarded when it holds nothing)."""
        acc = self.accumulator
        st = acc.state
        # acc.ledger is the last finished window's until a microbatch opens a new one: a rank that ran none has 0
        local = acc.ledger if st.window.open else None
        m_here = 0 if local is None else local.microbatches_local
        w_here = 0.0 if local is None else local.weight_local or 0.0
        # the token: drawn by the group's first rank, the others add 0
        token = (secrets.randbits(sums.TOKEN_BITS) or 1) if st.rank == 0 else 0
        here = torch.tensor([float(m_here), float(w_here), float(token)], dtype=torch.float64)
        self._in_group(here, dist.ReduceOp.SUM)  # the group's ranks agree on whether it ran anything
        m, w, token = int(here[0]), float(here[1]), int(here[2])
        if m == 0 or (local is not None and local.weighting == "weighted" and w == 0):
            acc.discard()  # the accumulator refuses an empty window: this group sends zeros instead
            mode = NONE if m == 0 else WEIGHTED
            return _Group(m, w, mode, 1.0, [0.0] * len(st.tensors))
        ledger = acc.finish()
        mode = _MODES.get(ledger.weighting, sums.OTHER)
        weight = ledger.weight_global if ledger.weight_global is not None else 0.0
        part = ledger.participation_global or {}
        divisor = 1.0 if ledger.divisor is None else float(ledger.divisor)
        return _Group(ledger.microbatches_global or 0, weight, mode, divisor, [float(part[n]) for n in st.names],
                      token)

    def _reduce(self, mine: _Group, slots: int, step: int, send: bool) -> _Attempt:
        """Stages 2 to 4 once: the SUM and the counts through torchft's all-reduce, read back, and the commit.

        The group's own gradients (``acc.finish()``'s, divided by ``D_g``) are left as they are until the step
        commits: they are the window a retry sends again (the all-reduced buffer may be corrupted by a failure, as
        torchft warns), so a retry needs no second gradient-sized buffer.
        """
        tensors = self.accumulator.state.tensors
        slot = self.manager.participating_rank() if send else None
        counts = sums.counts(mine.microbatches, mine.weight, mine.mode, mine.participation, slots, slot,
                             mine.token if send else 0, self.accumulator.state.world)
        flats = self._flats = sums.flatten(tensors, mine.divisor, self._flats, zeros=not send)
        for t in [*flats.buffers.values(), counts]:
            # one at a time: after a failure torchft makes the next all-reduce a no-op, where one already issued
            # would wait out the whole timeout for a peer that is gone (the process group runs them in order anyway)
            self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM).wait()
        total = None if self.manager.errored() is not None else sums.Totals.of(counts, slots)
        problem = self._agree(total, None if total is None else total.problem(self.group))
        if problem is not None:  # every rank of every group that read the sums raises, and its group's other ranks
            self.manager.report_error(problem)
            self.manager.should_commit()
            self._discard()
            raise problem
        if total is None:
            # should_commit() still runs: it is the group's agreement (its other ranks wait in it) and torchft's count
            # of failed commits; it says False here
            self.manager.should_commit()
            return _Attempt(step, slots, send, None, "a torchft all-reduce failed (a replica group died or timed out)")
        if total.divisor == 0:  # should_commit() then says False on every group
            self.manager.report_error(GradaggError("no microbatch in any replica group: there is no mean to take"))
        if not self.manager.should_commit():
            return _Attempt(step, slots, send, total, "should_commit() was False")
        sums.install(tensors, flats, total.divisor, total.participation)
        self._remember(step, total.tokens)
        return _Attempt(step, slots, send, total)

    def _agree(self, total: sums.Totals | None, problem: GradaggError | None) -> GradaggError | None:
        """What the group's ranks read, agreed inside the group (one small all-reduce): the smallest and largest
        group size, and whether a rank refuses the step.

        torchft pairs rank r of each group in its all-reduce. Groups of different sizes leave a rank of the larger
        with no partner: its process group fails to reconfigure, so its all-reduce errors and it reads nothing,
        while rank 0 of its group sums with the others and reads their sizes. The agreement tells the ranks that
        read nothing, so every rank of every group that took part refuses the step (a group must not commit a step
        its ranks read differently; and the ranks of one group must all leave finish() the same way, or the one
        that retries waits in a quorum for the one that raised).
        """
        st = self.accumulator.state
        seen = [st.world, *(() if total is None else total.sizes)]
        view = torch.tensor([max(seen), -min(seen), float(problem is not None)], dtype=torch.float64)
        self._in_group(view, dist.ReduceOp.MAX)
        largest, smallest = int(view[0]), int(-view[1])
        where = f"group {self.group}, rank {st.rank} of {st.world}"
        if largest != smallest:
            return CollectiveError(
                f"{where}: replica groups of {largest} ranks and of {smallest} rank{'s' * (smallest != 1)} in one "
                "torchft step; torchft's all-reduce pairs rank r of each group, so a rank of the larger has no "
                "partner and its group cannot commit: give every replica group the same number of ranks (restart "
                "a group that lost a rank with its full size)")
        if problem is None and view[2]:
            return CollectiveError(f"{where}: another rank of this group refused the step (its error says why)")
        return problem

    def _in_group(self, t: torch.Tensor, op: Any) -> None:
        """All-reduce ``t`` over this group's own ranks (nothing with one rank): the group's agreements.

        Raises:
            CollectiveError: it failed: a rank of this group is gone. torchft cannot keep a group that lost a rank
                (its manager waits for every rank it was built with, at each quorum and ``should_commit()``): this
                rank refuses the step and leaves, the other groups go on without the group.
        """
        st = self.accumulator.state
        if st.world == 1:
            return
        try:
            dist.all_reduce(t, op=op, group=st.group)
        except RuntimeError as e:  # gloo's "Connection closed by peer" or its timeout (DistBackendError among them)
            self._discard()  # local: the window is dropped, as for any refusal
            raise CollectiveError(
                f"group {self.group}, rank {st.rank} of {st.world}: the all-reduce inside the replica group failed "
                f"({first_line(e)}); a rank of the group is gone, and torchft cannot keep a group that lost one (its "
                f"manager waits for all {st.world} at every quorum): restart the group with all its ranks, it heals "
                "from the others") from e

    def _stale(self, first_step: int, step: int, before: torch.Tensor | None) -> bool:
        """The retry's quorum healed this group: its window was computed on parameters the step no longer holds.

        Its step moved (the others committed the step), or a heal at the same step (torchft's ``init_sync`` at
        step 0) replaced its parameters with different ones. The group's ranks agree (one small all-reduce).
        """
        moved = step != first_step
        changed = self._healed and before is not None and not torch.equal(before, _fingerprint(
            self.accumulator.state.tensors))
        flag = torch.tensor([float(moved or changed)], dtype=torch.float64)
        self._in_group(flag, dist.ReduceOp.SUM)
        return bool(flag.item())

    def _commit(self, mine: _Group, keys: tuple[Hashable, ...], attempt: _Attempt, first_step: int,
                attempts: int, why: str | None = None) -> StepReport:
        """The step committed: the gradients hold its mean; say where this group's window went (``why``: the reason
        it was not applied, where the caller knows it better than the attempt count)."""
        total = attempt.total
        assert total is not None
        made = self._made(mine, keys, attempt, attempts, divisor=total.divisor)
        if attempt.sent or not keys:
            return self._keep(StepReport(committed=True, applied_in=attempt.step, **made))
        elsewhere = self._applied_elsewhere(mine, first_step)
        if elsewhere is not None:
            return self._keep(StepReport(committed=True, applied_in=elsewhere, **made))
        why = why or ("not participating (healing, or a spare): this group's data sat the step out" if attempts == 1
                      else f"stale: the retry's quorum healed this group (step {first_step} -> {attempt.step}): its "
                      "window was computed on parameters the step no longer holds")
        return self._keep(StepReport(committed=True, skipped=keys, reason=why, **made))

    def _drop(self, mine: _Group, keys: tuple[Hashable, ...], attempt: _Attempt, first_step: int,
              attempts: int) -> StepReport:
        """No attempt committed: the gradients are dropped; the window is skipped unless another group committed it."""
        self._discard()
        made = self._made(mine, keys, attempt, attempts, divisor=None)
        elsewhere = self._applied_elsewhere(mine, first_step)
        if elsewhere is not None:
            return self._keep(StepReport(committed=False, applied_in=elsewhere, **made))
        return self._keep(StepReport(committed=False, skipped=keys, reason=attempt.failure, **made))

    def _made(self, mine: _Group, keys: tuple[Hashable, ...], attempt: _Attempt, attempts: int,
              divisor: float | None) -> dict[str, Any]:
        total = attempt.total
        weighted = total is not None and total.mode == WEIGHTED
        return dict(step=attempt.step, group=self.group, group_microbatches=mine.microbatches, keys=keys,
                    group_weight=mine.weight if mine.mode == WEIGHTED else None, attempts=attempts,
                    participating=attempt.sent and total is not None, divisor=divisor,
                    microbatches=None if total is None else total.microbatches,
                    per_participant=() if total is None else total.per_slot(),
                    weight=total.weight if weighted and total is not None else None)

    def _applied_elsewhere(self, mine: _Group, first_step: int) -> int | None:
        """The step the other groups committed this window in, by its token in their record (a heal brought it)."""
        return first_step if mine.token and mine.token in self._committed.get(first_step, ()) else None

    # --- the record of committed windows, handed to a group that heals ------------------------------------------

    def _remember(self, step: int, tokens: frozenset[int]) -> None:
        self._committed[step] = tokens
        for old in [s for s in self._committed if s <= step - _KEEP_STEPS]:
            del self._committed[old]

    def _record(self) -> dict[str, Any]:
        return {"committed": {step: sorted(tokens) for step, tokens in self._committed.items()}}

    def _load_record(self, record: dict[str, Any]) -> None:
        self._healed = True
        for step, tokens in record.get("committed", {}).items():
            self._committed[int(step)] = frozenset(int(t) for t in tokens)

    def _keep(self, report: StepReport) -> StepReport:
        self.history.append(report)
        return report

    def _discard(self) -> None:
        self.accumulator.discard()
        for t in self.accumulator.state.tensors:
            t.grad = None


_CHUNK = 1 << 18
"""Elements per float64 piece of the fingerprint: a whole parameter in float64 would cost twice its size again."""


def _fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each parameter's sum and sum of squares, in float64: a heal that replaces them with other values changes it.

    >>> _fingerprint([torch.tensor([1.0, 2.0]), torch.zeros(3)]).tolist()
    [[3.0, 5.0], [0.0, 0.0]]
    """
    out = torch.zeros(len(tensors), 2, dtype=torch.float64)
    for row, t in zip(out, tensors):
        for piece in torch.split(sums.local(t.detach()).reshape(-1), _CHUNK):
            x = piece.double()
            row[0] += x.sum()
            row[1] += x.square().sum()
    return out


def exact(manager: Manager, accumulator: MicrobatchAccumulator, *, group: str = "", retries: int = 1) -> ReplicaGroups:
    """Sum ``accumulator``'s windows across torchft's replica groups, each step divided by the counts that took part.

    Args:
        manager: this rank's ``torchft.Manager``.
        accumulator: the group's :class:`~gradagg.torch.MicrobatchAccumulator`, over the group's own ranks
            (``group=`` the replica group's process group; plain, DDP or FSDP2 inside it, every group alike).
        group: a name for the reports (torchft's replica id).
        retries: how many times a failed step's reduction is retried among the survivors, from the saved window
            (a new quorum at the same step, then the all-reduce again); 0 is torchft's own behaviour: the step is
            dropped and every group's window skipped.

    Returns:
        The :class:`ReplicaGroups`; run each microbatch in its ``microbatch(weight=..., key=...)``.

    Raises:
        GradaggError: the accumulator has ``terms=``; ``retries`` is not an int >= 0; the manager already has one.

    Its loop needs torchft's lighthouse and processes, hence the skip (the tests run it)::

    >>> ft = exact(manager, MicrobatchAccumulator(model))  # doctest: +SKIP
    """
    return ReplicaGroups(manager, accumulator, group, retries)


__all__ = ["Manager", "ReplicaGroups", "StepReport", "exact"]
