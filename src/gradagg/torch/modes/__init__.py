"""Named aggregation modes of a per-token loss, exact over the optimizer step's window on all ranks.

The window is every microbatch of every rank between two optimizer steps: not one microbatch, not the
generation batch. A **sequence** is a row, or a segment of a packed row (``position_ids`` restarting at
0, or ``cu_seqlens``); n_s its valid (unmasked) tokens; a fully masked sequence (n_s = 0) counts in no
divisor. A **group** is the completions of one prompt; N_g the sum of its n_s. Over the window, with S the
non-empty sequences (#S of them), G the non-empty groups (#G), T = sum n_s, l_t a token's loss, C a declared constant:

| mode | value over the window | per microbatch: ``loss`` / ``weight`` | needs |
|---|---|---|---|
| token-mean | sum_t l_t / T | sum l_t / valid tokens | nothing |
| seq-mean-token-mean | (1/#S) sum_s (sum_s l_t / n_s) | sum_s (sum_s l_t / n_s) / sequences | whole seqs |
| seq-mean-token-sum | (1/#S) sum_t l_t | sum l_t / sequences | whole seqs |
| seq-mean-token-sum-norm | sum_t l_t / (#S C) | sum l_t / (sequences x C) | whole seqs |
| group-token-mean | (1/#G) sum_g (sum_g l_t / N_g) | sum_t l_t / N_g(t) / groups it owns | plan_window |

Back-propagate ``loss`` inside ``acc.microbatch(weight=weight)``: ``MicrobatchAccumulator.finish()``
divides the sum over every microbatch of every rank by the sum of every weight, so each ``.grad`` is the
mode's gradient over the window, however the window is split into microbatches and ranks (uneven, none on
a rank included). "sequences" counts the microbatch's non-empty ones.

TRL's ``loss_type`` read over the window: ``grpo`` is seq-mean-token-mean; ``bnpo``, ``dapo`` and ``cispo``
are token-mean (TRL divides by the microbatch's or the generation batch's count instead); ``dr_grpo`` is
seq-mean-token-sum-norm with C = ``max_completion_length`` (TRL also counts fully masked completions in |S|;
here they count in no divisor).

**Counted as the window runs** (:func:`token_mean` and the three ``seq-*`` functions): every sequence must be
whole inside one microbatch (a row, or a segment of a packed row). No collective beyond ``finish()``'s.

**Counted ahead** (:func:`plan_window`, then ``plan=`` and ``microbatch=``): needed by ``group-token-mean``
(a group's completions span microbatches and ranks, and 1 / N_g multiplies each token's loss before backward),
and by the ``seq-*`` modes when a sequence is split across microbatches or context-parallel ranks (give every
piece the same ``seq_ids``). Requires every rank's layout of the window (masks, boundaries, ids; not the losses)
before its first backward, as RL has it from the generation batch; one ``all_gather_object`` per window;
``plan.check(ledger)`` after ``finish()`` refuses a window that ran otherwise than planned.

>>> import torch
>>> from gradagg.torch import MicrobatchAccumulator
>>> w = torch.zeros(1, requires_grad=True)
>>> acc = MicrobatchAccumulator([("w", w)])
>>> for mask in (torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1]])):  # 2 microbatches
...     part = aggregate("seq-mean-token-mean", (w + 1.0).expand(mask.shape) * torch.ones(mask.shape), mask)
...     with acc.microbatch(weight=part.weight):
...         part.loss.backward()
>>> acc.finish().divisor, w.grad   # 3 sequences; each sequence's token mean of d(w + 1)/dw = 1
(3.0, tensor([1.]))
"""

from __future__ import annotations

import torch

from gradagg.errors import GradaggError
from gradagg.torch.modes.local import Mode, Part, as_you_go, mode_of
from gradagg.torch.modes.planned import Layout, WindowPlan, plan_window

Tensor = torch.Tensor


def aggregate(
    mode: Mode | str,
    loss: Tensor,
    mask: Tensor,
    *,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    norm: float | None = None,
    plan: WindowPlan | None = None,
    microbatch: int | None = None,
) -> Part:
    """One microbatch's :class:`Part` of ``mode``: what to back-propagate and the weight to give the accumulator.

    Args:
        mode: a :class:`Mode` or its name (``"token-mean"``, ...).
        loss: the per-token loss, (T,) or (B, T); a masked token's value is never read.
        mask: the valid tokens, the loss's shape, bool or 0/1.
        position_ids: packed rows: a sequence starts where the position is 0 (and at each row's start).
        cu_seqlens: packed rows: the sequences' offsets in the flattened tokens, from 0 to their number.
        norm: C for ``seq-mean-token-sum-norm`` (e.g. the maximum completion length); no other mode takes one.
        plan: the window counted ahead (:func:`plan_window`); then ``microbatch`` is this microbatch's index in
            it, and ``mask``, boundaries and ``norm`` were given there (``mask`` must be the planned one).
        microbatch: with ``plan``, this microbatch's index among the rank's planned layouts.

    Returns:
        ``Part(loss, weight)``: run ``part.loss.backward()`` inside ``acc.microbatch(weight=part.weight)``.

    Raises:
        GradaggError: an unknown mode; a mask with values other than 0 and 1; shapes that differ; boundaries that
            do not cover the tokens; a missing or invalid ``norm``; ``group-token-mean`` without a plan; a plan of
            another mode, or a mask other than the planned one.

    >>> aggregate("token-mean", torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0]))
    Part(loss=tensor(3.), weight=tensor(2))
    """
    m = mode_of(mode)
    if plan is None and microbatch is None:
        return as_you_go(m, loss, mask, position_ids, cu_seqlens, norm)
    if plan is None or microbatch is None:
        raise GradaggError(
            f"{m.value}: give plan= and microbatch= together (got plan={plan!r}, microbatch={microbatch!r})"
        )
    if plan.mode != m:
        raise GradaggError(f"{m.value}: the plan was counted for {plan.mode.value}")
    if 0 <= microbatch < plan.microbatches and not torch.equal(plan.segs[microbatch].mask, _flat_bool(mask)):
        raise GradaggError(f"{m.value}, microbatch {microbatch}: the mask is not the one planned for it")
    return plan.part(microbatch, loss)


def _flat_bool(mask: Tensor) -> Tensor:
    return (mask if mask.dtype == torch.bool else mask != 0).reshape(-1)


def token_mean(loss: Tensor, mask: Tensor, **kw: object) -> Part:
    """``token-mean`` (DAPO, CISPO, SFT): sum of valid token losses / valid tokens, over the window.

    Args and Raises: as :func:`aggregate` (``mode`` given).

    Returns:
        ``Part(sum of valid losses, valid tokens)``.

    >>> token_mean(torch.tensor([[1.0, 2.0], [4.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]))
    Part(loss=tensor(7.), weight=tensor(3))
    """
    return aggregate(Mode.TOKEN_MEAN, loss, mask, **kw)  # type: ignore[arg-type]


def seq_mean_token_mean(loss: Tensor, mask: Tensor, **kw: object) -> Part:
    """``seq-mean-token-mean`` (GRPO as published): the mean over sequences of each one's token mean.

    Args and Raises: as :func:`aggregate` (``mode`` given).

    Returns:
        ``Part(sum over sequences of their token means, non-empty sequences)``.

    >>> seq_mean_token_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([1, 1, 1]), cu_seqlens=torch.tensor([0, 2, 3]))
    Part(loss=tensor(7.), weight=tensor(2))
    """
    return aggregate(Mode.SEQ_MEAN_TOKEN_MEAN, loss, mask, **kw)  # type: ignore[arg-type]


def seq_mean_token_sum(loss: Tensor, mask: Tensor, **kw: object) -> Part:
    """``seq-mean-token-sum``: sum of valid token losses / non-empty sequences.

    Args and Raises: as :func:`aggregate` (``mode`` given).

    Returns:
        ``Part(sum of valid losses, non-empty sequences)``.

    >>> seq_mean_token_sum(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([1, 1, 0]), position_ids=torch.tensor([0, 1, 0]))
    Part(loss=tensor(4.), weight=tensor(1))
    """
    return aggregate(Mode.SEQ_MEAN_TOKEN_SUM, loss, mask, **kw)  # type: ignore[arg-type]


def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, *, norm: float, **kw: object) -> Part:
    """``seq-mean-token-sum-norm`` (Dr. GRPO): sum of valid token losses / (non-empty sequences x ``norm``).

    Args and Raises: as :func:`aggregate` (``mode`` given); ``norm`` is required.

    Returns:
        ``Part(sum of valid losses, non-empty sequences x norm)``.

    >>> seq_mean_token_sum_norm(torch.tensor([[1.0, 3.0]]), torch.tensor([[1, 1]]), norm=4)
    Part(loss=tensor(4.), weight=tensor(4., dtype=torch.float64))
    """
    return aggregate(Mode.SEQ_MEAN_TOKEN_SUM_NORM, loss, mask, norm=norm, **kw)  # type: ignore[arg-type]


def group_token_mean(loss: Tensor, mask: Tensor, *, plan: WindowPlan, microbatch: int) -> Part:
    """``group-token-mean``: per prompt group the token mean over the window, then the mean over groups.

    Args and Raises: as :func:`aggregate` (``mode`` given); ``plan`` and ``microbatch`` are required.

    Returns:
        ``Part(sum of valid losses / their group's N_g, groups this microbatch owns)``.

    >>> lay = Layout(torch.tensor([[1, 1, 0], [1, 0, 0]]), group_ids=[7, 8])
    >>> plan = plan_window("group-token-mean", [lay])
    >>> group_token_mean(torch.tensor([[1.0, 3.0, 0.0], [5.0, 0.0, 0.0]]), lay.mask, plan=plan, microbatch=0)
    Part(loss=tensor(7.), weight=tensor(2))
    """
    return aggregate(Mode.GROUP_TOKEN_MEAN, loss, mask, plan=plan, microbatch=microbatch)


__all__ = [
    "Layout",
    "Mode",
    "Part",
    "WindowPlan",
    "aggregate",
    "group_token_mean",
    "plan_window",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
]
