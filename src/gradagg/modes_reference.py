"""The aggregation modes of an RL (or SFT) loss over one optimizer step, in pure Python: the oracle.

Standard library only, the full batch in one place: every fast path (:mod:`gradagg.torch.modes`, spread
over microbatches and ranks) is tested against these functions.

The window is the optimizer step's whole batch: every microbatch of every rank. A **sequence** is one
completion (a row, or one segment of a packed row); its tokens have a loss and a mask (valid or not); n_s is
its number of valid tokens. A sequence with n_s = 0 is fully masked: it counts in no divisor. A **group**
is the sequences of one prompt (GRPO's G completions); N_g is the sum of its sequences' n_s. With S the
non-empty sequences, G the non-empty groups, T = sum of n_s, and C a declared constant:

==========================  ===================================================  ======================
mode                        value                                                known as
==========================  ===================================================  ======================
token-mean                  sum of all valid token losses / T                    DAPO, CISPO, SFT, bnpo
seq-mean-token-mean         (1/|S|) sum_s (sum of s's losses / n_s)              GRPO as published
seq-mean-token-sum          (1/|S|) sum_s (sum of s's losses)                    verl
seq-mean-token-sum-norm     sum of all valid token losses / (|S| C)              Dr. GRPO
group-token-mean            (1/|G|) sum_g (sum of g's losses / N_g)              DAPO per group
==========================  ===================================================  ======================

>>> seqs = [Seq([1.0, 3.0], [True, True], group=0), Seq([5.0, 9.0], [True, False], group=1), Seq([7.0], [False])]
>>> [aggregate(m, seqs, norm=4) for m in MODES]
[3.0, 3.5, 4.5, 1.125, 3.5]
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from gradagg.errors import GradaggError

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "group-token-mean")
"""The mode names, as verl's ``loss_agg_mode`` spells the first four."""


@dataclass(frozen=True)
class Seq:
    """One whole sequence: a loss per token, a mask per token (True: valid), and its prompt group (or None)."""

    losses: Sequence[float]
    mask: Sequence[bool]
    group: Hashable = None

    def valid(self) -> list[float]:
        """The losses of the valid tokens (a masked token's loss is never read)."""
        return [x for x, m in zip(self.losses, self.mask) if m]


def aggregate(mode: str, seqs: Sequence[Seq], *, norm: float | None = None) -> float:
    """The value of ``mode`` over the whole window ``seqs`` (see the table above).

    Args:
        mode: one of :data:`MODES`.
        seqs: every sequence of the window, whole.
        norm: C, the declared constant of ``seq-mean-token-sum-norm`` (e.g. the maximum completion length).

    Returns:
        The aggregated loss.

    Raises:
        GradaggError: an unknown mode; no valid token in the window; ``norm`` missing or not positive.

    >>> aggregate("seq-mean-token-mean", [Seq([2.0, 4.0], [True, True]), Seq([1.0], [True])])
    2.0
    """
    full = [s.valid() for s in seqs if any(s.mask)]
    if mode not in MODES:
        raise GradaggError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(MODES)}")
    if not full:
        raise GradaggError(f"{mode}: no valid token in the window's {len(seqs)} sequences: nothing to divide by")
    if mode == "token-mean":
        return math.fsum(x for v in full for x in v) / sum(len(v) for v in full)
    if mode == "seq-mean-token-mean":
        return math.fsum(math.fsum(v) / len(v) for v in full) / len(full)
    if mode == "seq-mean-token-sum":
        return math.fsum(x for v in full for x in v) / len(full)
    if mode == "seq-mean-token-sum-norm":
        if norm is None or not norm > 0 or not math.isfinite(norm):
            raise GradaggError(f"seq-mean-token-sum-norm needs a declared positive constant norm, got {norm!r}")
        return math.fsum(x for v in full for x in v) / (len(full) * norm)
    return _group_token_mean([s for s in seqs if any(s.mask)])


def _group_token_mean(seqs: Sequence[Seq]) -> float:
    groups: dict[Hashable, list[float]] = {}
    for s in seqs:
        if s.group is None:
            raise GradaggError("group-token-mean: a sequence has no group")
        groups.setdefault(s.group, []).extend(s.valid())
    return math.fsum(math.fsum(v) / len(v) for v in groups.values()) / len(groups)


def unpack(
    losses: Sequence[float],
    mask: Sequence[bool],
    *,
    position_ids: Sequence[int] | None = None,
    cu_seqlens: Sequence[int] | None = None,
) -> list[tuple[list[float], list[bool]]]:
    """Split one packed row into its sequences: ``(losses, mask)`` per sequence, in order.

    A new sequence starts at the row's first token and wherever ``position_ids`` is 0 (the convention of
    transformers' packed rows); or ``cu_seqlens`` gives the offsets ``[0, l0, l0 + l1, ..., len(row)]``.
    With neither, the row is one sequence.

    Args:
        losses: the row's token losses.
        mask: the row's token mask.
        position_ids: the row's position ids.
        cu_seqlens: cumulative sequence lengths.

    Returns:
        One ``(losses, mask)`` pair per sequence.

    Raises:
        GradaggError: both boundaries given, or offsets that do not cover the row.

    >>> unpack([1, 2, 3, 4], [1, 1, 0, 1], position_ids=[0, 1, 0, 0])
    [([1, 2], [1, 1]), ([3], [0]), ([4], [1])]
    >>> unpack([1, 2, 3], [1, 1, 1], cu_seqlens=[0, 1, 3])
    [([1], [1]), ([2, 3], [1, 1])]
    """
    if position_ids is not None and cu_seqlens is not None:
        raise GradaggError("give position_ids or cu_seqlens, not both")
    n = len(losses)
    if cu_seqlens is not None:
        cuts = list(cu_seqlens)
        if not cuts or cuts[0] != 0 or cuts[-1] != n or any(b < a for a, b in zip(cuts, cuts[1:])):
            raise GradaggError(f"cu_seqlens {cuts} does not cover a row of {n} tokens from 0, non-decreasing")
    elif position_ids is not None:
        cuts = [t for t in range(n) if t == 0 or position_ids[t] == 0] + [n]
    else:
        cuts = [0, n]
    return [(list(losses[a:b]), list(mask[a:b])) for a, b in zip(cuts, cuts[1:])]


__all__ = ["MODES", "Seq", "aggregate", "unpack"]
