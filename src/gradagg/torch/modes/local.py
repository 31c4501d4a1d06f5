"""The modes counted as the window runs: every sequence whole inside its microbatch, no collective of its own.

Each returns a :class:`Part`: the numerator to back-propagate and the weight whose sum over the window, on
every rank, the accumulator divides by. Because the window's divisor is a sum of per-microbatch counts for
these modes, ``MicrobatchAccumulator.finish()`` makes the mode exact with nothing counted ahead.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import NamedTuple

import torch

from gradagg.errors import GradaggError
from gradagg.torch.modes.segments import Segments, check_loss, segments


class Mode(StrEnum):
    """The aggregation modes, by the names verl's ``loss_agg_mode`` and its users know (``Mode("token-mean")``)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
    GROUP_TOKEN_MEAN = "group-token-mean"


class Part(NamedTuple):
    """One microbatch's share of a mode: ``with acc.microbatch(weight=part.weight): part.loss.backward()``.

    Attributes:
        loss: the numerator over this microbatch's tokens (a 0-dim tensor in the loss's dtype).
        weight: what this microbatch adds to the window's divisor (a 0-dim tensor: int64, or float64 for
            ``seq-mean-token-sum-norm``); read by the accumulator when the window finishes.
    """

    loss: torch.Tensor
    weight: torch.Tensor


def mode_of(mode: object) -> Mode:
    """The :class:`Mode` named by ``mode`` (a string or a Mode).

    Raises:
        GradaggError: an unknown name, listing the known ones.

    >>> mode_of("token-mean") is Mode.TOKEN_MEAN
    True
    """
    try:
        return Mode(mode)  # type: ignore[arg-type]
    except ValueError:
        raise GradaggError(
            f"unknown aggregation mode {mode!r}; expected one of {', '.join(m.value for m in Mode)}"
        ) from None


def check_norm(mode: Mode, norm: object) -> float | None:
    """The declared constant C: required by ``seq-mean-token-sum-norm`` (finite, positive), refused by the others.

    Raises:
        GradaggError: C missing, not a positive finite number, or given to another mode.
    """
    if mode != Mode.SEQ_MEAN_TOKEN_SUM_NORM:
        if norm is not None:
            raise GradaggError(
                f"{mode.value} takes no norm (got {norm!r}); only seq-mean-token-sum-norm divides by one"
            )
        return None
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not math.isfinite(norm) or norm <= 0:
        raise GradaggError(
            f"seq-mean-token-sum-norm needs norm=C, a declared positive constant (e.g. the maximum completion "
            f"length), got {norm!r}"
        )
    return float(norm)


def part_of(mode: Mode, seg: Segments, loss: torch.Tensor, norm: float | None) -> Part:
    """The :class:`Part` of one microbatch whose sequences are all whole in it (see the package's table)."""
    sums, nonempty = seg.sums(loss), (seg.tokens > 0).sum()
    if mode == Mode.TOKEN_MEAN:
        return Part(sums.sum(), seg.tokens.sum())
    if mode == Mode.SEQ_MEAN_TOKEN_MEAN:  # a fully masked sequence adds 0 / 1 here and counts in no divisor
        return Part((sums / seg.tokens.clamp(min=1)).sum(), nonempty)
    if mode == Mode.SEQ_MEAN_TOKEN_SUM:
        return Part(sums.sum(), nonempty)
    if mode == Mode.SEQ_MEAN_TOKEN_SUM_NORM and norm is not None:  # check_norm made sure it is given
        return Part(sums.sum(), nonempty.double() * norm)
    raise GradaggError(NEEDS_PLAN)


NEEDS_PLAN = (
    "group-token-mean needs each prompt group's token count over the whole window (a group's completions "
    "may span microbatches and ranks): build plan_window(...) on every rank and pass plan= and microbatch="
)


def as_you_go(
    mode: Mode,
    loss: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    norm: object,
) -> Part:
    """Check the inputs, unpack the microbatch's sequences, and return its :class:`Part`."""
    c = check_norm(mode, norm)
    if mode == Mode.GROUP_TOKEN_MEAN:
        raise GradaggError(NEEDS_PLAN)
    seg = segments(mask, position_ids=position_ids, cu_seqlens=cu_seqlens, where=mode.value)
    check_loss(loss, seg, mode.value)
    return part_of(mode, seg, loss, c)


__all__ = ["NEEDS_PLAN", "Mode", "Part", "as_you_go", "check_norm", "mode_of", "part_of"]
