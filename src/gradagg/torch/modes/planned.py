"""The modes whose divisor is not a sum of per-microbatch counts: the window's layout counted ahead, in one collective.

A prompt group's token count N_g, or a split sequence's n_s, is needed in the *numerator* of every piece
(each token's loss is divided by it before backward), and the group or sequence must count once in the
divisor however many microbatches and ranks hold its pieces. Both are known before the first backward
when the window's layout is: in RL the generation batch is made before the step's microbatches. So
:func:`plan_window` takes every rank's layouts (masks, boundaries, ids; no losses), gathers them in one
``all_gather_object``, and gives each piece its coefficient (1 / n_s or 1 / N_g, from the global totals) and
each group or sequence one owner: the first (rank, microbatch) holding one of its valid tokens, whose
weight counts it. Every rank computes the same totals and owners from the same gathered data.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradagg.errors import GradaggError
from gradagg.torch.collectives import Group, all_gather_object, get_rank
from gradagg.torch.modes.local import Mode, Part, check_norm, mode_of
from gradagg.torch.modes.segments import Segments, check_loss, segments

Piece = tuple[Hashable, Hashable, int]  # (sequence id, group id or None, valid tokens here)


@dataclass(frozen=True)
class Layout:
    """What :func:`plan_window` needs of one microbatch: no loss, only which tokens count and who they belong to.

    Attributes:
        mask: the valid tokens, (T,) or (B, T), bool or 0/1.
        position_ids: for packed rows, the mask's shape; a sequence starts where it is 0.
        cu_seqlens: for packed rows, the offsets of the sequences in the flattened tokens.
        seq_ids: one id per sequence of this microbatch (rows, or segments in order), the same id for every
            piece of a sequence split across microbatches or ranks (e.g. its index in the generation batch).
            None: every sequence is whole here.
        group_ids: one prompt-group id per sequence (required by ``group-token-mean``).
    """

    mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    seq_ids: Sequence[Hashable] | torch.Tensor | None = None
    group_ids: Sequence[Hashable] | torch.Tensor | None = None


@dataclass(frozen=True)
class WindowPlan:
    """The window's counts on all ranks, and this rank's coefficients and weights per microbatch.

    Attributes:
        mode: the aggregation mode.
        norm: C for ``seq-mean-token-sum-norm``, else None.
        tokens: T, the valid tokens of the window on all ranks.
        sequences: |S|, the non-empty sequences of the window on all ranks (a split sequence once).
        groups: |G|, the non-empty prompt groups on all ranks (None without group ids).
        divisor: what ``finish()`` must divide by: T, |S|, |S| C or |G|.
        microbatches: this rank's planned microbatches; ``microbatches_global``: all ranks'.
    """

    mode: Mode
    norm: float | None
    tokens: int
    sequences: int
    groups: int | None
    divisor: float
    microbatches: int
    microbatches_global: int
    segs: tuple[Segments, ...]
    coefs: tuple[torch.Tensor, ...]
    weights: tuple[float, ...]

    def part(self, microbatch: int, loss: torch.Tensor) -> Part:
        """Microbatch ``microbatch``'s :class:`Part`: sum of its valid token losses times their coefficients.

        Raises:
            GradaggError: an index outside the plan, or a loss not of the planned mask's shape.
        """
        if not 0 <= microbatch < self.microbatches:
            raise GradaggError(
                f"{self.mode.value}: microbatch {microbatch} is not among this rank's {self.microbatches}"
            )
        seg, where = self.segs[microbatch], f"{self.mode.value}, microbatch {microbatch}"
        check_loss(loss, seg, where)
        numer = (seg.sums(loss) * self.coefs[microbatch].to(loss.device, loss.dtype)).sum()
        dtype = torch.float64 if self.mode == Mode.SEQ_MEAN_TOKEN_SUM_NORM else torch.long
        return Part(numer, torch.tensor(self.weights[microbatch], dtype=dtype))

    def check(self, ledger: Any) -> None:
        """After ``finish()``: the accumulator divided by the planned divisor over the planned microbatches.

        Every rank holds the same ledger totals and plan, so every rank raises alike.

        Raises:
            GradaggError: naming both divisors or both microbatch counts.
        """
        got_m, got_d = ledger.microbatches_global, ledger.divisor
        if got_m != self.microbatches_global:
            raise GradaggError(
                f"{self.mode.value}: the window ran {got_m} microbatches on all ranks, "
                f"the plan {self.microbatches_global}"
            )
        if ledger.weighting != "weighted" or not math.isclose(got_d, self.divisor, rel_tol=1e-12):
            raise GradaggError(
                f"{self.mode.value}: finish() divided by {got_d} ({ledger.weighting}), the plan counted {self.divisor}"
            )


def plan_window(
    mode: Mode | str, layouts: Sequence[Layout], *, norm: float | None = None, group: Group = None
) -> WindowPlan:
    """Count the window's sequences and groups on all ranks, ahead of its first backward (one ``all_gather_object``).

    Call it on every rank, once per window, with this rank's microbatches' layouts (none is fine).

    Args:
        mode: the aggregation mode.
        layouts: this rank's microbatches, in the order they will run.
        norm: C, for ``seq-mean-token-sum-norm``.
        group: the process group of the accumulator (None: the default, or one process).

    Returns:
        The :class:`WindowPlan`: ``plan.part(k, token_loss)`` per microbatch, ``plan.check(ledger)`` after.

    Raises:
        GradaggError: on every rank: any rank's invalid layout (named by rank and microbatch), another mode or
            norm on another rank, a sequence id in two groups, no valid token in the window.
    """
    rank = get_rank(group)
    try:
        m = mode_of(mode)
        c = check_norm(m, norm)
        segs = tuple(
            segments(lay.mask, position_ids=lay.position_ids, cu_seqlens=lay.cu_seqlens, where=f"microbatch {k}")
            for k, lay in enumerate(layouts)
        )
        pieces = [_pieces(m, lay, seg, rank, k) for k, (lay, seg) in enumerate(zip(layouts, segs))]
        mine: dict[str, Any] = {"mode": m.value, "norm": c, "pieces": pieces}
    except GradaggError as exc:
        mine = {"error": str(exc)}
    everyone: list[dict[str, Any]] = all_gather_object(mine, group)  # type: ignore[assignment]
    _refuse_errors(everyone, rank)
    return _plan(m, c, segs, everyone, rank)


def _pieces(mode: Mode, lay: Layout, seg: Segments, rank: int, k: int) -> list[Piece]:
    seq_ids = _ids(lay.seq_ids, seg.count, f"microbatch {k}: seq_ids")
    group_ids = _ids(lay.group_ids, seg.count, f"microbatch {k}: group_ids")
    if mode == Mode.GROUP_TOKEN_MEAN and group_ids is None:
        raise GradaggError(f"group-token-mean: microbatch {k} has no group_ids (one per sequence)")
    counts = seg.tokens.tolist()
    return [
        (
            ("local", rank, k, j) if seq_ids is None else seq_ids[j],  # a sequence whole here: an id nobody shares
            None if group_ids is None else group_ids[j],
            counts[j],
        )
        for j in range(seg.count)
    ]


def _ids(ids: Sequence[Hashable] | torch.Tensor | None, count: int, where: str) -> list[Hashable] | None:
    if ids is None:
        return None
    got = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if len(got) != count:
        raise GradaggError(f"{where} has {len(got)} ids for the {count} sequences of the microbatch")
    if any(i is None for i in got):
        raise GradaggError(f"{where}: an id is None")
    return got


def _refuse_errors(everyone: list[dict[str, Any]], rank: int) -> None:
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if "error" in e]
    if errors:
        raise GradaggError(f"rank {rank}: plan_window refused on every rank: {'; '.join(errors)}")
    kinds = {(e["mode"], e["norm"]) for e in everyone}
    if len(kinds) > 1:
        said = ", ".join(f"rank {r}: {e['mode']} norm={e['norm']}" for r, e in enumerate(everyone))
        raise GradaggError(f"rank {rank}: plan_window got other modes or norms on other ranks ({said})")


def _plan(
    mode: Mode, norm: float | None, segs: tuple[Segments, ...], everyone: list[dict[str, Any]], rank: int
) -> WindowPlan:
    seq_tokens, group_of, group_tokens = _totals(everyone)
    seq_owner, group_owner = _owners(everyone)
    if not seq_owner:
        raise GradaggError(f"{mode.value}: no valid token in the window on any of the {len(everyone)} ranks")
    coefs, weights = [], []
    for k, pieces in enumerate(everyone[rank]["pieces"]):
        coefs.append(
            torch.tensor([_coef(mode, s, g, seq_tokens, group_tokens) for s, g, _ in pieces], dtype=torch.float64)
        )
        weights.append(_weight(mode, norm, pieces, seq_owner, group_owner, (rank, k)))
    tokens, sequences = sum(seq_tokens.values()), len(seq_owner)
    groups = len(group_owner) if all(g is not None for g in group_of.values()) else None
    divisor = {
        Mode.TOKEN_MEAN: tokens,
        Mode.SEQ_MEAN_TOKEN_MEAN: sequences,
        Mode.SEQ_MEAN_TOKEN_SUM: sequences,
        Mode.SEQ_MEAN_TOKEN_SUM_NORM: sequences * (norm or 1.0),
        Mode.GROUP_TOKEN_MEAN: groups or 0,
    }[mode]
    m_global = sum(len(e["pieces"]) for e in everyone)
    return WindowPlan(
        mode, norm, tokens, sequences, groups, divisor, len(segs), m_global, segs, tuple(coefs), tuple(weights)
    )


def _totals(
    everyone: list[dict[str, Any]],
) -> tuple[dict[Hashable, int], dict[Hashable, Hashable], dict[Hashable, int]]:
    """n_s per sequence id, its group (the same on every piece), N_g per group: summed over all ranks."""
    seq_tokens: dict[Hashable, int] = {}
    group_of: dict[Hashable, Hashable] = {}
    seen_at: dict[Hashable, tuple[int, int]] = {}
    for r, e in enumerate(everyone):
        for k, pieces in enumerate(e["pieces"]):
            for s, g, n in pieces:
                if s in group_of and group_of[s] != g:
                    (r0, k0) = seen_at[s]
                    raise GradaggError(
                        f"sequence {s!r} is in group {group_of[s]!r} on rank {r0} microbatch {k0} but in group {g!r} "
                        f"on rank {r} microbatch {k}: a sequence has one prompt group"
                    )
                group_of.setdefault(s, g)
                seen_at.setdefault(s, (r, k))
                seq_tokens[s] = seq_tokens.get(s, 0) + n
    group_tokens: dict[Hashable, int] = {}
    for s, n in seq_tokens.items():
        if group_of[s] is not None:
            group_tokens[group_of[s]] = group_tokens.get(group_of[s], 0) + n
    return seq_tokens, group_of, group_tokens


def _owners(everyone: list[dict[str, Any]]) -> tuple[dict[Hashable, tuple[int, int]], dict[Hashable, tuple[int, int]]]:
    """Each non-empty sequence's and group's owner: the first (rank, microbatch) with one of its valid tokens."""
    seq_owner: dict[Hashable, tuple[int, int]] = {}
    group_owner: dict[Hashable, tuple[int, int]] = {}
    for r, e in enumerate(everyone):
        for k, pieces in enumerate(e["pieces"]):
            for s, g, n in pieces:
                if n > 0:
                    seq_owner.setdefault(s, (r, k))
                    if g is not None:
                        group_owner.setdefault(g, (r, k))
    return seq_owner, group_owner


def _coef(
    mode: Mode, s: Hashable, g: Hashable, seq_tokens: dict[Hashable, int], group_tokens: dict[Hashable, int]
) -> float:
    """What each valid token loss of a piece is multiplied by: 1 / n_s, 1 / N_g, or 1 (0 where nothing is valid)."""
    if mode == Mode.SEQ_MEAN_TOKEN_MEAN:
        return 1.0 / seq_tokens[s] if seq_tokens[s] else 0.0
    if mode == Mode.GROUP_TOKEN_MEAN:
        return 1.0 / group_tokens[g] if group_tokens[g] else 0.0
    return 1.0


def _weight(
    mode: Mode,
    norm: float | None,
    pieces: list[Piece],
    seq_owner: dict[Hashable, tuple[int, int]],
    group_owner: dict[Hashable, tuple[int, int]],
    here: tuple[int, int],
) -> float:
    if mode == Mode.TOKEN_MEAN:
        return float(sum(n for _, _, n in pieces))
    if mode == Mode.GROUP_TOKEN_MEAN:
        return float(len({g for _, g, _ in pieces if group_owner.get(g) == here}))
    owned = len({s for s, _, _ in pieces if seq_owner.get(s) == here})
    return owned * norm if mode == Mode.SEQ_MEAN_TOKEN_SUM_NORM and norm is not None else float(owned)


__all__ = ["Layout", "WindowPlan", "plan_window"]
