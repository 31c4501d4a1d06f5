"""Exactly-once microbatch accumulation over torch.distributed: :class:`MicrobatchAccumulator`.

Contract (the distributed form of :func:`gradagg.reference.microbatch_mean`):
after :meth:`MicrobatchAccumulator.finish`, every parameter's ``.grad`` is

    sum over all microbatches on all ranks of its gradient  /  M

where M, the divisor, is the number of microbatches actually run on all ranks
of the group, counted by the accumulator and summed in the same collective as
the gradients. A parameter absent from a microbatch (no gradient there)
contributes zero to the sum and still counts in M; one absent from every
microbatch on every rank keeps ``grad is None``. Participation (in how many
microbatches a parameter got a gradient) is reported in the :class:`Ledger`,
never used as a divisor.

How: autograd accumulates the *unscaled* microbatch gradients into ``.grad``
as usual; a post-accumulate-grad hook records which parameters received one in
each microbatch. In a process group the gradients live, from the first
microbatch on, in one flat buffer followed by the counters (participation per
parameter, M per rank, a status flag per rank), so ``finish()`` is one
``all_reduce`` of that buffer and one division, with no copy in and out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from torch.nn.parallel import DistributedDataParallel

import torch
from gradagg.errors import GradaggError, NonFiniteGradientError, WindowError
from gradagg.torch._buffers import ReusableBuffer
from gradagg.torch._flat import NonFinite, _all_finite, _FlatLayout
from gradagg.torch.collectives import (
    Group,
    all_reduce_sum,
    check_same_on_all_ranks,
    device_for,
    get_rank,
    get_world_size,
    is_distributed,
)

ParamSource = torch.nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

_Hook = Callable[[torch.Tensor], None]

# Status codes a rank sends in the collective, so that every rank raises together.
_OK, _POISONED, _STALE = 0.0, 1.0, 2.0


@dataclass(frozen=True)
class Ledger:
    """What one accumulation window counted. Global fields are None until :meth:`~MicrobatchAccumulator.finish`.

    Attributes:
        rank: this process's rank in the group (0 with no group).
        world_size: ranks in the group (1 with no group).
        microbatches_local: microbatches completed on this rank.
        microbatches_global: microbatches completed on all ranks: the divisor M.
        microbatches_per_rank: M split by rank.
        participation_local: parameter name -> microbatches in which it got a gradient, on this rank.
        participation_global: the same summed over ranks. Reported, never a divisor.
    """

    rank: int
    world_size: int
    microbatches_local: int
    microbatches_global: int | None
    microbatches_per_rank: tuple[int, ...] | None
    participation_local: dict[str, int]
    participation_global: dict[str, int] | None

    @property
    def divisor(self) -> int | None:
        """The divisor of the mean: M, the global microbatch count (None before finish)."""
        return self.microbatches_global

    def report(self) -> str:
        """A readable table of the window: M local and global, participation per parameter."""
        per_rank = "" if self.microbatches_per_rank is None else f" (per rank: {list(self.microbatches_per_rank)})"
        glob = "not finished" if self.microbatches_global is None else str(self.microbatches_global)
        width = max([len("parameter")] + [len(n) for n in self.participation_local])
        lines = [
            f"accumulation window, rank {self.rank} of {self.world_size}",
            f"microbatches: local {self.microbatches_local}, global {glob}{per_rank}; divisor M = {glob}",
            f"{'parameter':<{width}}  {'local':>6}  {'global':>6}",
        ]
        for name, local in self.participation_local.items():
            g = "-" if self.participation_global is None else str(self.participation_global[name])
            lines.append(f"{name:<{width}}  {local:>6}  {g:>6}")
        lines.append("participation = microbatches in which the parameter got a gradient; reported, never a divisor")
        return "\n".join(lines)


class MicrobatchAccumulator:
    """Average gradients over the microbatches actually run on all ranks, each counted exactly once.

    Usage, on every rank (the forward may be inside or outside the ``with``)::

        acc = MicrobatchAccumulator(model)           # or a DDP-wrapped model, or parameters
        for x, y in my_microbatches:                  # any number per rank, uneven across ranks
            with acc.microbatch():
                loss_fn(model(x), y).backward()       # the UNSCALED microbatch loss
        acc.finish()                                  # grads = sum / M, M counted on all ranks
        optimizer.step(); optimizer.zero_grad()       # set_to_none (torch's default)

    Args:
        module_or_params: a module (its ``named_parameters()``), a ``DistributedDataParallel``-wrapped
            module, tensors, or ``(name, tensor)`` pairs. Parameters without ``requires_grad`` are ignored;
            a tensor given twice (tied weights) is one parameter.
        group: a process group, or None for the default one; with no process group at all the
            accumulator works in one process with no communication.
        nonfinite: ``"propagate"`` (default): NaN and Inf flow through the sum, and since every rank
            receives the same reduced buffer every rank sees the same non-finite values;
            ``"raise"``: :meth:`finish` raises :class:`NonFiniteGradientError` on every rank, naming the
            ranks whose gradients were non-finite (costs one extra pass over the gradients).

    DDP: while attached, the accumulator turns off DDP's gradient all_reduce and its per-forward
    buffer broadcast (both would be one collective per microbatch, mismatched when ranks run
    different numbers of microbatches, and DDP divides by the world size, which is wrong for uneven
    counts); :meth:`finish` does the reduction. :meth:`close` restores DDP's flags.

    >>> lin = torch.nn.Linear(1, 1, bias=False)
    >>> acc = MicrobatchAccumulator(lin)
    >>> for x in (1.0, 3.0):
    ...     with acc.microbatch():
    ...         lin(torch.tensor([[x]])).sum().backward()
    >>> _ = acc.finish()
    >>> lin.weight.grad  # (1 + 3) / M, M = 2
    tensor([[2.]])
    """

    # window state, (re)set by _reset()
    _open: bool
    _in_microbatch: bool
    _seen: set[int]  # parameters that got a gradient in the current microbatch
    _m_local: int
    _participation: list[int]
    _poison: str | None  # why the window cannot be finished, if it cannot
    _flat: torch.Tensor | None  # the flat gradient buffer of a distributed window
    _last: Ledger | None

    def __init__(
        self, module_or_params: ParamSource, *, group: Group = None, nonfinite: NonFinite = "propagate"
    ) -> None:
        if nonfinite not in ("propagate", "raise"):
            raise GradaggError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")
        self._ddp = module_or_params if isinstance(module_or_params, DistributedDataParallel) else None
        self._ddp_flags = (True, True) if self._ddp is None else _silence_ddp(self._ddp)
        self._names, self._params = _named_params(module_or_params)
        self._group = group
        self._nonfinite: NonFinite = nonfinite
        self._closed = False
        self._layout_checked = False  # ranks compared their parameter lists (once, at the first finish)
        self._pool = ReusableBuffer()  # the flat gradient buffer of distributed windows, reused when free
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(self._params)
        ]
        self._reset()

    # --- the window --------------------------------------------------------

    @contextlib.contextmanager
    def microbatch(self) -> Iterator[None]:
        """One microbatch: run its backward (unscaled loss) inside the ``with``.

        A microbatch that raises after a gradient was accumulated poisons the window
        (:meth:`finish` then raises on every rank until :meth:`discard`); one that raises before
        touching any gradient (e.g. in the forward) is simply not counted.

        Returns:
            A context manager.

        Raises:
            WindowError: nested microbatches, or a gradient present before the window opened.
        """
        self._check_not_closed()
        if self._in_microbatch:
            raise WindowError("microbatch() entered inside another microbatch(); microbatches do not nest")
        if not self._open:
            self._open_window()
        if self._ddp is not None:
            _silence_ddp(self._ddp)  # in case user code switched DDP's sync back on
        self._in_microbatch, self._seen = True, set()
        try:
            yield
        except BaseException as exc:
            if self._seen:
                self._poison = (
                    f"microbatch {self._m_local} raised {type(exc).__name__}: {exc} after gradients were accumulated"
                )
            raise
        else:
            self._m_local += 1
            for i in self._seen:
                self._participation[i] += 1
        finally:
            self._in_microbatch = False

    def finish(self) -> Ledger:
        """Close the window: every ``.grad`` becomes the sum over all microbatches of all ranks / M.

        One ``all_reduce`` in a process group (gradients, M per rank, participation and status in one
        buffer); none without. The first finish() of an accumulator also checks, with one small
        ``all_gather_object``, that every rank accumulates the same parameters (names, shapes, dtypes).
        The window is then closed; the next :meth:`microbatch` opens a new one and requires the
        gradients to be None again (``optimizer.zero_grad()``). In a process group the gradients are
        views of one flat buffer, which a later window reuses only once no view of it is alive.

        Returns:
            The :class:`Ledger` of the window.

        Raises:
            WindowError: on every rank, when any rank's window is poisoned (a microbatch raised
                mid-backward, or a backward ran outside ``microbatch()``) or had gradients before it
                opened; when no rank ran a microbatch (M = 0); when called inside a microbatch.
            NonFiniteGradientError: on every rank, with ``nonfinite="raise"`` and a NaN or Inf gradient.
            CollectiveError: the ranks' parameter lists differ (every rank, naming the parameter); the
                collective failed or timed out (e.g. a peer died).
        """
        self._check_not_closed()
        if self._in_microbatch:
            raise WindowError("finish() called inside microbatch(); finish after the last microbatch's with-block")
        if is_distributed(self._group):
            return self._finish_distributed()
        return self._finish_local()

    def discard(self) -> None:
        """Drop the window: every gradient back to None, counters to zero. Local; call it on every rank.

        >>> acc = MicrobatchAccumulator([torch.zeros(1, requires_grad=True)])
        >>> acc.discard(); acc.ledger.microbatches_local
        0
        """
        for p in self._params:
            p.grad = None
        self._reset()

    def close(self) -> None:
        """Remove the hooks and give a DDP module its own synchronisation back; the accumulator is then unusable."""
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync, self._ddp.require_forward_param_sync = self._ddp_flags

    @property
    def ledger(self) -> Ledger:
        """The current window's counts (global counts after :meth:`finish`), or the last finished window's."""
        if self._last is not None and not self._open:
            return self._last
        return self._local_ledger()

    def report(self) -> str:
        """The ledger as readable text (see :meth:`Ledger.report`)."""
        return self.ledger.report()

    # --- internals -------------------------------------------------------------

    def _check_not_closed(self) -> None:
        if self._closed:
            raise WindowError("this accumulator was closed (its hooks are gone); create a new one")

    def _reset(self) -> None:
        self._open = False
        self._in_microbatch = False
        self._seen = set()
        self._m_local = 0
        self._participation = [0] * len(self._params)
        self._poison = None
        self._flat = None
        self._last = None

    def _hook(self, i: int) -> _Hook:
        def mark(_: torch.Tensor) -> None:
            if self._in_microbatch:
                self._seen.add(i)
            elif self._open and self._poison is None:
                self._poison = f"parameter {self._names[i]!r} got a gradient outside microbatch() (not counted in M)"

        return mark

    def _open_window(self) -> None:
        stale = self._stale_param()
        if stale is not None:
            raise WindowError(
                f"parameter {stale!r} already has a gradient when the accumulation window opens; "
                "zero the gradients with optimizer.zero_grad() (set_to_none=True) after each step"
            )
        self._reset()
        self._open = True
        if is_distributed(self._group):
            self._flat = self._layout().install(self._pool)

    def _stale_param(self) -> str | None:
        return next((self._names[i] for i, p in enumerate(self._params) if p.grad is not None), None)

    def _layout(self) -> _FlatLayout:
        return _FlatLayout(self._params, device_for(self._group), get_world_size(self._group), self._nonfinite)

    def _local_ledger(self, per_rank: tuple[int, ...] | None = None, glob: list[int] | None = None) -> Ledger:
        return Ledger(
            rank=get_rank(self._group),
            world_size=get_world_size(self._group),
            microbatches_local=self._m_local,
            microbatches_global=None if per_rank is None else sum(per_rank),
            microbatches_per_rank=per_rank,
            participation_local=dict(zip(self._names, self._participation)),
            participation_global=None if glob is None else dict(zip(self._names, glob)),
        )

    def _finish_local(self) -> Ledger:
        if self._poison is not None:
            raise WindowError(f"the accumulation window is poisoned: {self._poison}; call discard()")
        if self._m_local == 0:
            raise WindowError("finish() with no microbatch run (M = 0): there is no mean to take")
        grads = [p.grad for p in self._params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, float(self._m_local))  # the divisor: counted microbatches
        ledger = self._close_window((self._m_local,), list(self._participation))
        if self._nonfinite == "raise":
            bad = [n for n, p in zip(self._names, self._params) if p.grad is not None and not _all_finite(p.grad)]
            if bad:
                raise NonFiniteGradientError(f"rank 0: non-finite gradients after accumulation in {bad}")
        return ledger

    def _check_layout(self) -> None:
        """Every rank must flatten the same parameters in the same order, or the sums would mix them."""
        if not self._layout_checked:
            entries: list[tuple[object, str]] = [
                (n, f"(shape={tuple(p.shape)}, dtype={str(p.dtype).removeprefix('torch.')})")
                for n, p in zip(self._names, self._params)
            ]
            check_same_on_all_ranks(entries, "accumulated parameters", self._group)
            self._layout_checked = True

    def _finish_distributed(self) -> Ledger:
        self._check_layout()
        layout = self._layout()
        flat = self._flat if self._flat is not None else layout.zeros(self._pool)
        rank = get_rank(self._group)
        status = _OK
        if self._poison is not None:
            status = _POISONED
        elif not self._open and self._stale_param() is not None:
            status = _STALE  # no microbatch here, yet a gradient: someone skipped zero_grad
        layout.pack(flat, self._params, self._participation, self._m_local, rank, status)
        all_reduce_sum(flat, self._group)
        counts = layout.counts(flat)
        self._raise_if_any_failed(counts.status, rank)
        m = sum(counts.per_rank)
        if m == 0:
            self.discard()
            raise WindowError("finish() with no microbatch run on any rank (M = 0): there is no mean to take")
        layout.unpack(flat, self._params, counts.participation, m)
        ledger = self._close_window(tuple(counts.per_rank), counts.participation)
        if counts.nonfinite:
            raise NonFiniteGradientError(
                f"rank {rank}: non-finite gradients on rank(s) {counts.nonfinite}; every rank raises, "
                "with the same reduced (non-finite) gradients in .grad: zero them and skip this step"
            )
        return ledger

    def _raise_if_any_failed(self, status: list[float], rank: int) -> None:
        bad = {r: s for r, s in enumerate(status) if s != _OK}
        if not bad:
            return
        mine = f" (here: {self._poison})" if self._poison else ""
        self._poison = self._poison or f"rank(s) {sorted(bad)} failed in the window"
        self._open = True  # stays poisoned on every rank until discard()
        reasons = {
            r: (
                "poisoned (a microbatch raised mid-backward or a stray backward)"
                if s == _POISONED
                else "had gradients before its window"
            )
            for r, s in bad.items()
        }
        raise WindowError(
            f"rank {rank}: finish() refused on every rank: "
            + "; ".join(f"rank {r} {why}" for r, why in reasons.items())
            + f"{mine}; call discard() on every rank"
        )

    def _close_window(self, per_rank: tuple[int, ...], glob: list[int]) -> Ledger:
        ledger = self._local_ledger(per_rank, glob)
        self._reset()  # counters to zero: a second finish() cannot divide the same sums twice
        self._last = ledger
        return ledger


def _silence_ddp(ddp: DistributedDataParallel) -> tuple[bool, bool]:
    old = (ddp.require_backward_grad_sync, ddp.require_forward_param_sync)
    ddp.require_backward_grad_sync = False
    ddp.require_forward_param_sync = False
    return old


def _named_params(source: ParamSource) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(source, DistributedDataParallel):
        source = source.module
    items: Iterable[object] = source.named_parameters() if isinstance(source, torch.nn.Module) else source
    names: list[str] = []
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for k, item in enumerate(items):
        name, t = (f"param[{k}]", item) if isinstance(item, torch.Tensor) else _pair(item)
        if not isinstance(t, torch.Tensor):
            raise GradaggError(f"expected a module, tensors or (name, tensor) pairs; item {k} is {type(item).__name__}")
        if t.requires_grad and id(t) not in seen:  # a tied weight is one parameter
            seen.add(id(t))
            names.append(name)
            params.append(t)
    return names, params


def _pair(item: object) -> tuple[str, object]:
    if isinstance(item, tuple) and len(item) == 2:
        return str(item[0]), item[1]
    return "?", item


__all__ = ["Ledger", "MicrobatchAccumulator", "NonFinite"]
