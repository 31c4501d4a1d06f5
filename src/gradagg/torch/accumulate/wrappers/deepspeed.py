"""A DeepSpeed ZeRO engine (stages 1, 2 and 3): DeepSpeed reduces the window's gradients, the accumulator counts.

DeepSpeed's ``engine.coalesce_grad_reduction()`` (public, 0.19+) keeps every backward's gradient local on the
parameters and issues one reduction when its block exits, averaging over the data-parallel ranks. So a window is
one such block, entered when the window opens: every parameter is *external* (DeepSpeed reduces it; the flat
buffer carries the counters only), and the gradient hooks count participation without taking any gradient. At
``finish()``, after the counters' exchange, each local gradient is divided by this rank's share of the divisor,
``D / world`` (a parameter without one gets zeros: every rank must hand DeepSpeed's reduction the same tensors, or
its collectives mismatch), and the block exits: DeepSpeed's average is then the sum over every microbatch of every
rank / D. Where DeepSpeed sums over the ranks instead (``"gradient_allreduce_op": "sum"``), the share is D.
The share goes through the one divisor rule (:func:`~gradagg.torch.accumulate.counting.divisor_problem`):
dividing by a normal float32 rounds once, as the flat buffer's division by D does, where multiplying by
``world / D`` lost bits when that factor fell near float32's smallest normal and overflowed beyond its largest.
A dropped window hands DeepSpeed zeros and exits the block, so its reduction still runs on every rank.

In bf16 (``wide``) the parameters, and so autograd's ``.grad`` that DeepSpeed's block keeps local, are bf16: left
there, every backward of the window would add into a bf16 sum, which loses a small gradient beside a large one
(256 + 1 = 256 in bf16's 8 bits). So at the end of each microbatch each ``.grad`` is added into a float32 sum of
the window and set to None, and at ``finish()`` the float32 sum is divided by the share and rounded to bf16 once,
for DeepSpeed's reduction: the window's sum is never held in bf16.

DeepSpeed is never imported here: the engine is the caller's (see :mod:`gradagg.integrations.deepspeed`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from gradagg.errors import WindowError
from gradagg.torch.accumulate.counting import divisor_problem
from gradagg.torch.accumulate.state import State
from gradagg.torch.accumulate.wrappers.plain import Plain


class DeepSpeedZero(Plain):
    """The :class:`~gradagg.torch.accumulate.seam.Wrapper` of a DeepSpeed ZeRO engine.

    Args:
        engine: a ``DeepSpeedEngine`` with ZeRO stage 1, 2 or 3 (checked by the caller).
        n_params: how many parameters the accumulator holds (all of them external).
        averages: whether DeepSpeed's reduction averages over the ranks (its default) or sums them
            (``"gradient_allreduce_op": "sum"``): each rank's share of D is then D / world, or D.
        wide: keep the window's sums in float32 (a bf16 engine), handed to DeepSpeed in the gradients' dtype.
    """

    name = "deepspeed"

    def __init__(self, engine: Any, n_params: int, averages: bool = True, wide: bool = False) -> None:
        super().__init__()
        self.engine = engine
        self.averages = averages
        self.wide = wide
        self.external = frozenset(range(n_params))
        self.block: contextlib.ExitStack | None = None  # the window's coalesce_grad_reduction(), while open
        self.sums: dict[int, torch.Tensor] = {}  # wide: parameter -> this rank's float32 sum of the window

    def open(self, state: State) -> None:
        if self.block is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.engine.coalesce_grad_reduction())
            self.block = stack

    def after_microbatch(self, state: State) -> None:
        self._widen(state)

    def prepare(self, state: State, ran: bool) -> None:
        self._widen(state)  # Accelerate steps inside its sync microbatch: that backward's .grad is still there

    def _widen(self, state: State) -> None:
        """Wide: each ``.grad`` this window's backwards left, added into its float32 sum, then None."""
        if not self.wide or self.block is None:
            return
        for i, t in enumerate(state.tensors):
            g = t.grad
            if g is None:
                continue
            total = self.sums.get(i)
            if total is None:
                self.sums[i] = g.detach().to(torch.float32, copy=True)
            else:
                total.add_(g.detach())  # promoted: the addition rounds in float32
            t.grad = None

    def hand_out(self, state: State, i: int, t: torch.Tensor, divisor: float, present: bool) -> None:
        """Divide ``t``'s local gradient by its share of D (zeros where it has none): ``D / world`` where DeepSpeed
        then averages over the ranks, D where it sums them.

        Raises:
            WindowError: on every rank (D and the world are the same on each) when ``t``'s dtype cannot divide by
                the share; the caller drops the window (:meth:`discard`).
        """
        share = divisor / state.world if self.averages else divisor
        total = self.sums.pop(i, None)
        problem = divisor_problem(share, torch.float32 if self.wide else t.dtype)
        if problem is not None:
            how = "averages over the ranks, so each rank's gradient sum is divided by D / world" if self.averages \
                else "sums over the ranks, so each rank's gradient sum is divided by D"
            raise WindowError(f"rank {state.rank}: the window's total weight D = {divisor!r} over {state.world} "
                              f"ranks: DeepSpeed {how} = {share!r}, which {problem}; nothing was stepped")
        if total is None:
            _divide_or_fill(t, share)
        else:  # divided in float32, then rounded once to the gradients' dtype
            _set_grad(t, total.div_(share).to(t.dtype))

    def close(self, state: State) -> None:
        block, self.block = self.block, None
        if block is not None:
            block.close()  # DeepSpeed's flush: its one reduction of the window, averaged over the ranks

    def discard(self, state: State) -> None:
        self.sums = {}
        if self.block is None:
            return
        for t in state.tensors:
            _divide_or_fill(t, None)
        self.close(state)

    def refuses_terms(self) -> str | None:
        return ("terms= with DeepSpeed: its reduction averages one gradient per parameter, so the terms' sums "
                "cannot be kept apart")


def _divide_or_fill(p: torch.Tensor, share: float | None) -> None:
    """Divide ``p``'s local gradient by ``share`` (None: zero it); give it a zero one when it has none.

    Under ZeRO-3 a parameter between forwards holds an empty partition, while its gradient has the full shape
    (``ds_shape``, DeepSpeed's attribute): torch's ``.grad`` setter refuses a gradient of another shape, so the
    zeros go in through ``.data``, as DeepSpeed's own stage 3 does.
    """
    if p.grad is not None:
        if share is None:
            p.grad.zero_()
        else:
            p.grad.div_(share)
        return
    shape = tuple(getattr(p, "ds_shape", p.shape))
    _set_grad(p, torch.zeros(shape, dtype=p.dtype, device=p.device))


def _set_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """``p.grad = grad``, also where ``p`` holds an empty ZeRO-3 partition (see :func:`_divide_or_fill`)."""
    if tuple(p.shape) == tuple(grad.shape):
        p.grad = grad
    else:
        p.grad = torch.zeros_like(p)
        p.grad.data = grad


__all__ = ["DeepSpeedZero"]
