"""The accumulator's machinery: its parameters, hooks, buffer and window opening (see :mod:`gradagg.torch.accumulate`).

:class:`AccumulatorCore` holds the state that :class:`~gradagg.torch.MicrobatchAccumulator` (the public
API) and :mod:`gradagg.torch._finish` (the end of a window) work on. The hook is the heart of it: after
autograd accumulated a microbatch's gradient into ``param.grad``, the hook adds it into the flat buffer
and sets ``param.grad = None``, so nothing outside the accumulator (``zero_grad()``, a clip) can change
a counted gradient during the window, and under FSDP2 the unsharded gradient never reaches FSDP.
"""

from __future__ import annotations

from typing import Any

import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.options import NonFinite
from gradagg.torch import _finish
from gradagg.torch._buckets import Groups, Sender
from gradagg.torch._buffers import ReusableBuffer
from gradagg.torch._flat import FlatLayout, ParamSpec, buffer_dtype
from gradagg.torch._params import Params, ParamSource
from gradagg.torch._window import CHANGED, LATE, OUTSIDE, UNSUPPORTED, Window
from gradagg.torch.collectives import Group, device_for, get_rank, get_world_size
from gradagg.torch.ddp import DdpHold
from gradagg.torch.fsdp import FsdpParams, Mode, is_dtensor, low_precision
from gradagg.torch.ledger import Ledger

_BYTES_PER_MB = 2**20


class AccumulatorCore:
    """The state of a :class:`~gradagg.torch.MicrobatchAccumulator`; not used on its own."""

    def _setup(
        self, module_or_params: ParamSource, group: Group, nonfinite: NonFinite, fsdp: Mode, bucket_mb: float
    ) -> None:
        self._nonfinite = nonfinite
        if not isinstance(bucket_mb, int | float) or isinstance(bucket_mb, bool) or not bucket_mb > 0:
            raise GradaggError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        self._params = Params.collect(module_or_params)
        self._names, self._tensors = self._params.names, self._params.tensors
        self._group, self._bucket_mb = group, float(bucket_mb)
        self._fsdp = self._make_fsdp(fsdp)
        self._ddp = DdpHold(self._params.ddp) if self._params.ddp is not None else None
        self._hooked: dict[int, tuple[torch.Tensor, Any]] = {}  # id(tensor) -> (tensor, hook handle)
        self._unsharded: dict[int, torch.Tensor] = {}  # FSDP2: parameter index -> its unsharded tensor
        for i, t in enumerate(self._tensors):
            if self._fsdp is None or i not in self._sharded:
                self._hook(t, i)
            elif self._fsdp.mode == "every_microbatch":
                self._hook(t, i, self._on_shard)  # FSDP calls it with each microbatch's reduced shard
        self._pools = (ReusableBuffer(), ReusableBuffer())  # input buffer; reduce-scatter output
        self._layout: FlatLayout | None = None
        self._layout_checked = False
        self._closed = False
        self._extra_hooks: list[Any] = []
        if self._fsdp is not None and self._fsdp.mode == "window" and self._params.module is not None:
            # a forward before the first microbatch() would all-gather in forward order: open the window first
            self._extra_hooks.append(
                self._params.module.register_forward_pre_hook(self._open_before_forward, prepend=True)
            )
        self._next_last: bool | None = None  # set by microbatches(): whether the next microbatch is the last
        self._last: Ledger | None = None
        self._reset()

    def _make_fsdp(self, mode: Mode) -> FsdpParams | None:
        self._sharded = set(self._params.sharded)
        if not self._sharded:
            if mode not in ("window", "every_microbatch"):
                raise GradaggError(f"fsdp must be 'window' or 'every_microbatch', got {mode!r}")
            return None
        if self._params.module is None:
            raise GradaggError("DTensor parameters: pass the module fully_shard was applied to, not its parameters")
        idx = sorted(self._sharded)
        return FsdpParams(
            self._params.module,
            [self._names[i] for i in idx],
            [self._tensors[i] for i in idx],
            mode,
            get_world_size(self._group),
        )

    def _check_not_closed(self) -> None:
        if self._closed:
            raise WindowError("this accumulator was closed (its hooks are gone); create a new one")

    def _reset(self) -> None:
        self._w = Window(len(self._tensors))
        self._flat: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._sender: Sender | None = None
        self._shard_sums: dict[int, torch.Tensor] = {}  # every_microbatch: FSDP's reduced shards, summed here

    def _takes(self, i: int) -> bool:
        return self._fsdp is None or i not in self._sharded or self._fsdp.mode == "window"

    def _hook(self, t: torch.Tensor, i: int, on: Any = None) -> None:
        if id(t) in self._hooked:
            return
        take = self._on_grad if on is None else on

        def on_grad(param: torch.Tensor) -> None:
            take(i, param)

        self._hooked[id(t)] = (t, t.register_post_accumulate_grad_hook(on_grad))  # type: ignore[no-untyped-call]

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        """A gradient for parameter ``i`` was just accumulated into ``param.grad``: take it into the buffer."""
        w = self._w
        if not w.in_microbatch:
            if w.open:
                w.fail(OUTSIDE, f"parameter {self._names[i]!r} got a gradient outside microbatch() (not counted in M)")
            return
        grad = param.grad
        if self._takes(i) and grad is not None and self._flat is not None and self._sender is not None:
            if grad.layout != torch.strided:
                w.fail(UNSUPPORTED, f"parameter {self._names[i]!r} got a {grad.layout} gradient; only dense ones count")
            elif self._sender.sent(i):
                w.fail(
                    LATE,
                    f"parameter {self._names[i]!r} got a gradient after its bucket was sent "
                    "(a second backward in the microbatch marked last?)",
                )
            else:
                layout = self._layout_now()
                with torch.no_grad():
                    layout.add(self._flat, i, grad, first=layout.copies_first() and i not in w.written)
                w.written.add(i)
            param.grad = None
        w.seen.add(i)
        if w.in_last and self._sender is not None:
            self._sender.ready(i)

    def _on_shard(self, i: int, param: torch.Tensor) -> None:
        """every_microbatch: FSDP just reduce-scattered a microbatch into the sharded ``param.grad``; sum it here.

        FSDP would add each microbatch's shard into ``.grad`` in the parameter's dtype: for bf16 parameters a
        sum of M microbatches in bf16 (256 + 1 rounds to 256). Here the sum is kept in float32 at least, and
        ``.grad`` stays None until ``finish()``. FSDP calls the sharded parameter's post-accumulate-grad hooks
        after each reduce (for optimizers in backward); where it does not (compiled autograd), it keeps the sum
        in ``.grad``: :meth:`_shard_mean` folds that in, and :meth:`_kept_by_fsdp` refuses it in bf16 or fp16.
        Participation is counted on the unsharded parameter (:meth:`_on_grad`).
        """
        grad = param.grad
        if grad is None or not self._w.open:
            return  # before any window: left in .grad, so the next window refuses it as stale
        local = grad.to_local() if is_dtensor(grad) else grad  # type: ignore[attr-defined]
        total = self._shard_sums.get(i)
        if total is None:
            dtype = torch.promote_types(torch.float32, local.dtype)
            self._shard_sums[i] = local.detach().to(dtype=dtype, copy=True)
        else:
            total.add_(local.detach())
        param.grad = None

    def _shard_mean(self, i: int, t: torch.Tensor, divisor: float) -> torch.Tensor | None:
        """every_microbatch: parameter ``i``'s summed shards divided by D, as a DTensor gradient (None if none)."""
        total = self._shard_sums.pop(i, None)
        if t.grad is not None:  # FSDP summed (some of) it into .grad itself: its hook did not run
            kept = t.grad.to_local().detach()  # type: ignore[attr-defined]
            total = kept.to(dtype=torch.promote_types(torch.float32, kept.dtype)) if total is None else total.add_(kept)
        if total is None or self._fsdp is None:
            return None
        if divisor != 1:
            total.div_(divisor)
        return self._fsdp.sharded_grad(t, total)

    def _kept_by_fsdp(self) -> str | None:
        """every_microbatch: why a shard FSDP summed into ``.grad`` itself cannot count (a bf16 or fp16 sum)."""
        if self._fsdp is None or self._fsdp.mode != "every_microbatch":
            return None
        for i in sorted(self._sharded):
            g = self._tensors[i].grad
            if g is not None and low_precision(g.dtype):
                return (
                    f"parameter {self._names[i]!r}: FSDP summed microbatches into its {g.dtype} .grad itself (its "
                    "post-accumulate-grad hooks did not run, e.g. under compiled autograd); use fsdp='window'"
                )
        return None

    def _open_before_forward(self, _module: object, _args: object) -> None:
        if torch.is_grad_enabled() and not self._w.open and not self._closed:
            self._open_window()

    def _check_params(self) -> None:
        changed = self._params.changed()
        if changed is not None:
            self._w.fail(CHANGED, changed + "; build a new accumulator after changing requires_grad")

    def _stale_param(self) -> str | None:
        tensors = [(self._names[i], t) for i, t in enumerate(self._tensors)]
        tensors += [(self._names[i], t) for i, t in self._unsharded.items()]
        return next((n for n, t in tensors if t.grad is not None), None)

    def _open_window(self, *, empty: bool = False) -> None:
        """Open a window: check the parameters, unshard under FSDP2, allocate the buffer, reset the counters."""
        stale = self._stale_param()
        if stale is not None and not empty:
            raise WindowError(
                f"parameter {stale!r} already has a gradient when the accumulation window opens; "
                "zero the gradients with optimizer.zero_grad() (set_to_none=True) after each step"
            )
        w = self._w
        w.open = True
        _finish.check_layout(self)
        self._check_params()
        if self._fsdp is not None:
            for name, t in self._fsdp.unshard().items():
                i = self._names.index(name)
                self._unsharded[i] = t
                self._hook(t, i)
        layout = self._layout_now()
        self._flat = layout.fresh(self._pools[0])
        self._out = layout.output(self._pools[1])
        groups = Groups(self._group)
        if self._fsdp is not None:
            groups = Groups(self._group, self._fsdp.shard_group, self._fsdp.replicate_group)
        self._sender = Sender(layout, self._flat, self._out, groups, self._nonfinite == "raise", w.written)

    def _layout_now(self) -> FlatLayout:
        if self._layout is None:
            self._layout = self._build_layout()
        return self._layout

    def _build_layout(self) -> FlatLayout:
        specs = []
        for i, t in enumerate(self._tensors):
            kind = "reduce_scatter" if i in self._sharded else "all_reduce"
            if i in self._sharded and self._fsdp is not None and self._fsdp.mode == "every_microbatch":
                kind = "external"  # FSDP reduces it itself; only its participation is counted here
            specs.append(ParamSpec(tuple(t.shape), t.dtype, kind))  # type: ignore[arg-type]
        elem = torch.empty(0, dtype=buffer_dtype(specs)).element_size()
        ways, shard_rank = (1, 0) if self._fsdp is None else (self._fsdp.ways, self._fsdp.shard_rank)
        return FlatLayout(
            specs,
            get_world_size(self._group),
            get_rank(self._group),
            device_for(self._group),
            int(self._bucket_mb * _BYTES_PER_MB / elem),
            ways,
            shard_rank,
        )


__all__ = ["AccumulatorCore"]
