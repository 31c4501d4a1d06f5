"""The named aggregation modes (issue 23, item 1): each against its pure-Python reference, then on gloo ranks.

One process: for seeded windows (the seed is printed), the parts of every microbatch summed and divided as
``finish()`` does equal :func:`gradagg.modes_reference.aggregate` over the full batch, whole sequences
(as you go) and sequences split across microbatches (planned), padded and packed rows; the known wrong fixes
(mean of microbatch means; the generation batch's count; the local count) fail the same check. Then 2 and
3 gloo ranks, plain, DDP and FSDP2, uneven microbatch counts with a rank running none: the gradient
against the float64 one-process full batch.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import pytest
import torch

from gradagg import modes_reference as ref
from gradagg.errors import GradaggError
from gradagg.testing import run_local_world
from gradagg.torch.modes import (
    Layout,
    Mode,
    aggregate,
    group_token_mean,
    plan_window,
    seq_mean_token_sum_norm,
    token_mean,
)
from tests.torch.workers import modes as wm

SEEDS = range(12)
# float64 sums of at most ~60 terms of size < 100, divided once, in another order than the reference's fsum:
# a few ulps relative; 1e-12 leaves room and is still 1e9 times finer than any wrong divisor below.
REL = 1e-12
WORLD: dict[str, Any] = {"collective_timeout_s": 20.0, "timeout_s": 300.0, "preload": ["torch._dynamo"]}


def close(got: float, want: float) -> bool:
    """The check every path must pass (and every wrong fix must fail)."""
    return math.isclose(got, want, rel_tol=REL, abs_tol=0.0)


def parts(mode: Mode, micros: list[wm.Micro], planned: bool) -> list[tuple[float, float]]:
    """(loss, weight) of each microbatch of one process's window, as floats."""
    plan = plan_window(mode, [m.layout for m in micros], norm=wm._norm(mode)) if planned else None
    out = []
    for k, mb in enumerate(micros):
        lay, loss = mb.layout, wm.token_loss(wm.model(), mb.x, mb.y).detach()
        if plan is None:
            p = aggregate(
                mode, loss, lay.mask, position_ids=lay.position_ids, cu_seqlens=lay.cu_seqlens, norm=wm._norm(mode)
            )
        else:
            p = aggregate(mode, loss, lay.mask, plan=plan, microbatch=k)
        out.append((float(p.loss), float(p.weight)))
    return out


def finished(ps: list[tuple[float, float]]) -> float:
    """What finish() makes of the parts: the sum of the losses over the sum of the weights."""
    return math.fsum(p for p, _ in ps) / math.fsum(w for _, w in ps)


def oracle(mode: Mode, seqs: list[wm.Sequence]) -> float:
    return wm.truth(mode, seqs)[2]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_torch_formula_is_the_reference(seed: int) -> None:
    """The float64 full-batch truth the distributed tests use agrees with the stdlib oracle, every mode."""
    print(f"seed {seed}")
    seqs = wm.make_window(seed)
    for mode in Mode:
        value, _, want = wm.truth(mode, seqs)
        assert close(value, want), (mode, value, want)


def test_the_seeded_windows_reach_every_layout() -> None:
    """The windows and microbatches the seeded tests above draw (SEEDS) reach each layout they are meant to check:
    padded rows, cu_seqlens and position_ids, a sequence split over two microbatches, a fully masked sequence, a
    microbatch holding several sequences and one holding a single one."""
    reached: Counter[str] = Counter()
    for seed in SEEDS:
        seqs = wm.make_window(seed)
        reached.update(["a fully masked sequence"] * sum(not bool(x.mask.any()) for x in seqs))
        for split in (False, True):
            micros = wm.share(seqs, [5 + seed % 5], seed, split)[0]
            for mb in micros:
                lay = mb.layout
                style = "cu_seqlens" if lay.cu_seqlens is not None else (
                    "position_ids" if lay.position_ids is not None else "rows")
                pieces = len(lay.seq_ids or [])
                reached.update([style, "several sequences" if pieces > 1 else "a single sequence"])
            ids = [i for mb in micros for i in (mb.layout.seq_ids or [])]
            reached.update(["a sequence split over two microbatches"] * (len(ids) - len(set(ids))))
    want = ["rows", "cu_seqlens", "position_ids", "a sequence split over two microbatches", "a fully masked sequence",
            "several sequences", "a single sequence"]
    assert all(reached[c] > 0 for c in want), reached


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_parts_make_the_mode_over_the_window(seed: int, split: bool) -> None:
    """5 to 9 microbatches in random styles (padded rows, cu_seqlens, position_ids); split: sequences cut in two."""
    print(f"seed {seed}")
    seqs = wm.make_window(seed)
    m = 5 + seed % 5
    micros = wm.share(seqs, [m], seed, split)[0]
    for mode in Mode:
        planned = split or mode == Mode.GROUP_TOKEN_MEAN
        got = finished(parts(mode, micros if split else [wm.whole(x) for x in micros], planned))
        assert close(got, oracle(mode, seqs)), (mode, got, oracle(mode, seqs))


def test_packed_rows_equal_unpacked_rows() -> None:
    """The same sequences as padded rows, one cu_seqlens row and one position_ids row: the same parts."""
    loss = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
    mask = torch.tensor([1, 1, 0, 1, 1])
    rows_loss, rows_mask = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 1, 0]])
    for mode in (Mode.TOKEN_MEAN, Mode.SEQ_MEAN_TOKEN_MEAN, Mode.SEQ_MEAN_TOKEN_SUM):
        rows = aggregate(mode, rows_loss, rows_mask)
        cu = aggregate(mode, loss, mask, cu_seqlens=torch.tensor([0, 3, 5]))
        pos = aggregate(mode, loss[None], mask[None], position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
        assert float(rows.loss) == float(cu.loss) == float(pos.loss), mode
        assert int(rows.weight) == int(cu.weight) == int(pos.weight) == (4 if mode == Mode.TOKEN_MEAN else 2)
    # the packed row read as one sequence (no boundaries) is another, wrong, seq-mean-token-mean: 27/4, not 1.5 + 12
    assert float(aggregate(Mode.SEQ_MEAN_TOKEN_MEAN, loss, mask).loss) == 27 / 4


# --- the known wrong fixes: the same check catches each -------------------------------------------------------


def mean_of_microbatch_means(ps: list[tuple[float, float]]) -> float:
    """TRL's grpo/bnpo before exactness (trl#3021): each microbatch divided by its own count, then / GA."""
    return math.fsum(p / w for p, w in ps if w) / len(ps)


def generation_batch_count(ps: list[tuple[float, float]], other: list[tuple[float, float]]) -> float:
    """TRL's dapo with steps_per_generation = 2 GA (trl#5619): the window divided by its generation batch's count,
    which also holds the next window's microbatches."""
    return math.fsum(p for p, _ in ps) / math.fsum(w for _, w in ps + other)


def local_count_times_world(per_rank: list[list[tuple[float, float]]]) -> float:
    """Each rank divides by its own count, DDP averages over ranks (a rank with none adds 0)."""
    return math.fsum(finished(ps) if ps else 0.0 for ps in per_rank) / len(per_rank)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_check_catches_the_known_wrong_fixes(seed: int) -> None:
    print(f"seed {seed}")
    seqs = wm.make_window(seed)
    counts = [2, 0, 3, 4]
    per_rank = wm.share(seqs, counts, seed, split=False)
    nxt = wm.share(wm.make_window(seed + 100), [3], seed + 100, split=False)[0]
    for mode in (Mode.TOKEN_MEAN, Mode.SEQ_MEAN_TOKEN_MEAN, Mode.SEQ_MEAN_TOKEN_SUM, Mode.SEQ_MEAN_TOKEN_SUM_NORM):
        ranks = [parts(mode, [wm.whole(x) for x in mine], planned=False) for mine in per_rank]
        window, want = [p for ps in ranks for p in ps], oracle(mode, seqs)
        assert close(finished(window), want), (mode, "the right one")
        other = parts(mode, [wm.whole(x) for x in nxt], planned=False)
        for name, wrong in [
            ("mean of microbatch means", mean_of_microbatch_means(window)),
            ("generation batch's count", generation_batch_count(window, other)),
            ("local count, ranks averaged", local_count_times_world(ranks)),
        ]:
            assert not close(wrong, want), (mode, name, wrong, want)


def test_group_token_mean_is_not_the_token_mean_nor_per_microbatch_groups() -> None:
    """Two groups, one of them split over two microbatches: group by group, with N_g over the window."""
    lays = [
        Layout(torch.tensor([[1, 1, 1], [1, 0, 0]]), group_ids=[0, 1]),
        Layout(torch.tensor([[1, 0, 0]]), group_ids=[1]),
    ]
    losses = [torch.tensor([[1.0, 1.0, 1.0], [10.0, 0.0, 0.0]]), torch.tensor([[20.0, 0.0, 0.0]])]
    plan = plan_window("group-token-mean", lays)
    ps = [group_token_mean(loss, lay.mask, plan=plan, microbatch=k) for k, (loss, lay) in enumerate(zip(losses, lays))]
    assert [int(p.weight) for p in ps] == [2, 0]  # group 1 counted once, where its first valid token is
    assert finished([(float(p.loss), float(p.weight)) for p in ps]) == (1.0 + 15.0) / 2
    assert (plan.tokens, plan.sequences, plan.groups, plan.divisor) == (5, 3, 2, 2)


# --- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: aggregate("tokens-mean", torch.ones(2), torch.ones(2)), "unknown aggregation mode 'tokens-mean'"),
        (lambda: aggregate("token-mean", torch.ones(2), torch.tensor([1.0, 0.5])), "mask[1] is 0.5"),
        (lambda: aggregate("token-mean", torch.ones(3), torch.ones(2)), "shape (3,), the mask (2,)"),
        (lambda: aggregate("token-mean", torch.ones(2, dtype=torch.long), torch.ones(2)), "floating-point"),
        (lambda: aggregate("token-mean", torch.ones(3), torch.ones(3), cu_seqlens=torch.tensor([0, 2])), "cu_seqlens"),
        (
            lambda: aggregate("token-mean", torch.ones(1, 3), torch.ones(1, 3), position_ids=torch.zeros(3)),
            "position_ids",
        ),
        (lambda: aggregate("token-mean", torch.ones(2), torch.ones(2), norm=4), "takes no norm"),
        (lambda: seq_mean_token_sum_norm(torch.ones(2), torch.ones(2), norm=0), "positive constant"),
        (lambda: aggregate("seq-mean-token-sum-norm", torch.ones(2), torch.ones(2)), "norm=C"),
        (lambda: aggregate("group-token-mean", torch.ones(2), torch.ones(2)), "plan_window"),
        (lambda: plan_window("group-token-mean", [Layout(torch.ones(2, 2))]), "microbatch 0 has no group_ids"),
        (
            lambda: plan_window("token-mean", [Layout(torch.ones(2, 2), seq_ids=[1])]),
            "microbatch 0: seq_ids has 1 ids for the 2 sequences",
        ),
        (
            lambda: plan_window("group-token-mean", [Layout(torch.ones(1, 2), group_ids=[0]),
                                                     Layout(torch.ones(2, 2), group_ids=[1, 2, 3])]),
            "microbatch 1: group_ids has 3 ids for the 2 sequences",
        ),
        (lambda: plan_window("token-mean", [Layout(torch.ones(2)), Layout(torch.tensor([1, 2]))]),
         "microbatch 1: mask"),
        (
            lambda: plan_window("token-mean", [Layout(torch.ones(2), cu_seqlens=torch.tensor([0, 1, 2])),
                                               Layout(torch.ones(2), cu_seqlens=torch.tensor([0, 3]))]),
            "microbatch 1: cu_seqlens",
        ),
        (lambda: plan_window("token-mean", [Layout(torch.ones(1, 2))]).part(0, torch.ones(1, 3)),
         "token-mean, microbatch 0: the token loss has shape (1, 3)"),
        (lambda: plan_window("token-mean", [Layout(torch.zeros(2, 2))]), "no valid token in the window"),
        (
            lambda: plan_window("group-token-mean", [Layout(torch.ones(2, 2), seq_ids=[5, 5], group_ids=[0, 1])]),
            "sequence 5 is in group 0",
        ),
    ],
)
def test_refusals_name_what_and_where(call: Any, fragment: str) -> None:
    with pytest.raises(GradaggError) as info:
        call()
    assert fragment in str(info.value), str(info.value)


def test_a_plan_refuses_another_mask_mode_or_window() -> None:
    lay = Layout(torch.tensor([[1, 1]]), group_ids=[3])
    plan = plan_window("group-token-mean", [lay])
    with pytest.raises(GradaggError, match="not the one planned"):
        aggregate("group-token-mean", torch.ones(1, 2), torch.tensor([[1, 0]]), plan=plan, microbatch=0)
    with pytest.raises(GradaggError, match="counted for group-token-mean"):
        aggregate("token-mean", torch.ones(1, 2), lay.mask, plan=plan, microbatch=0)
    with pytest.raises(GradaggError, match="microbatch 1 is not among"):
        plan.part(1, torch.ones(1, 2))
    w = torch.zeros(1, requires_grad=True)
    from gradagg.torch import MicrobatchAccumulator

    acc = MicrobatchAccumulator([("w", w)])
    for _ in range(2):  # one microbatch more than planned
        part = plan.part(0, (w + 1).expand(1, 2))
        with acc.microbatch(weight=part.weight):
            part.loss.backward()
    with pytest.raises(GradaggError, match="ran 2 microbatches on all ranks, the plan 1"):
        plan.check(acc.finish())


def test_reference_refuses() -> None:
    with pytest.raises(GradaggError, match="no valid token"):
        ref.aggregate("token-mean", [ref.Seq([1.0], [False])])
    with pytest.raises(GradaggError, match="unknown aggregation mode"):
        ref.aggregate("mean", [ref.Seq([1.0], [True])])


# --- on gloo ranks: the gradient against the float64 one-process full batch ------------------------------------


def _check_world(results: list[dict[str, Any]], n_cases: int) -> None:
    assert all(r.keys() == results[0].keys() for r in results)
    assert len(results[0]) == n_cases
    for case in results[0]:
        for r, res in enumerate(results):
            err, divisor = res[case]
            assert err <= REL, (case, r, err)
            assert divisor == results[0][case][1], (case, r)


@pytest.mark.parametrize("counts", [[0, 3], [2, 3]], ids=["0+3", "2+3"])
def test_two_ranks_plain_ddp_and_fsdp2(counts: list[int]) -> None:
    """Every mode, whole and split sequences, plain module, DDP and FSDP2 (fully_shard, the default shards form:
    a rank that ran out pads), rank 0 with none or fewer microbatches."""
    kinds = ["plain", "ddp", "fsdp"]
    results = run_local_world(wm.modes_world, 2, 7, counts, kinds, **WORLD)
    _check_world(results, 2 * len(Mode) * len(kinds))


def test_three_ranks_uneven_with_one_empty() -> None:
    results = run_local_world(wm.modes_world, 3, 3, [1, 0, 3], ["ddp"], **WORLD)
    _check_world(results, 2 * len(Mode))


def test_plan_window_refuses_on_every_rank() -> None:
    """One rank's bad layout, or ranks that disagree: a GradaggError on both ranks, naming the rank and what."""
    results = run_local_world(wm.refusals_world, 2, **WORLD)
    expected = {
        "bad ids on rank 1": "rank 1: microbatch 0: seq_ids has 1 ids for the 2 sequences",
        "a sequence in two groups": "sequence 0 is in group 0 on rank 0 microbatch 0 but in group 1 on rank 1",
        "another mode on rank 1": "rank 0: token-mean norm=None, rank 1: seq-mean-token-sum norm=None",
        "nothing valid anywhere": "no valid token in the window on any of the 2 ranks",
    }
    for r, res in enumerate(results):
        for case, fragment in expected.items():
            assert res[case] is not None and res[case][0] == "GradaggError", (case, r, res[case])
            assert fragment in res[case][1], (case, r, res[case][1])


def test_each_named_function_is_its_mode_with_the_same_arguments() -> None:
    """token_mean(...), seq_mean_token_sum_norm(..., norm=) and the others pass their mode, loss, mask and every
    keyword (packed rows' position_ids, the norm) to aggregate: the same parts as aggregate's."""
    from gradagg.torch import modes

    loss, mask = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0]]), torch.tensor([[1, 1, 0, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    for mode, fn, kw in [
        (Mode.TOKEN_MEAN, modes.token_mean, {}),
        (Mode.SEQ_MEAN_TOKEN_MEAN, modes.seq_mean_token_mean, {}),
        (Mode.SEQ_MEAN_TOKEN_SUM, modes.seq_mean_token_sum, {}),
        (Mode.SEQ_MEAN_TOKEN_SUM_NORM, modes.seq_mean_token_sum_norm, {"norm": 4.0}),
    ]:
        got, want = fn(loss, mask, position_ids=pos, **kw), aggregate(mode, loss, mask, position_ids=pos, **kw)
        assert (float(got.loss), float(got.weight)) == (float(want.loss), float(want.weight)), mode
    # packed: two sequences (1 + 2 and 8 + 16), not one: the position_ids reached aggregate
    assert float(modes.seq_mean_token_mean(loss, mask, position_ids=pos).weight) == 2.0
    assert float(modes.seq_mean_token_sum_norm(loss, mask, norm=4.0).weight) == 4.0  # one sequence x C


def test_a_plan_refuses_a_window_divided_by_another_count() -> None:
    """plan.check(ledger): the planned microbatches, but divided by another total (a weight changed), or not
    weighted at all, are refused naming both divisors; the planned one passes."""
    from gradagg.torch import MicrobatchAccumulator

    lay = Layout(torch.tensor([[1, 1, 0]]))
    plan = plan_window("token-mean", [lay])
    for weight, fragment in [(2.0, None), (3.0, "finish() divided by 3.0 (weighted), the plan counted 2"),
                             (None, "finish() divided by 1 (unweighted), the plan counted 2")]:
        w = torch.zeros(1, requires_grad=True)
        acc = MicrobatchAccumulator([("w", w)])
        with acc.microbatch(weight=weight):
            (w * 2).sum().backward()
        ledger = acc.finish()
        if fragment is None:
            plan.check(ledger)
        else:
            with pytest.raises(GradaggError, match=re.escape(fragment)):
                plan.check(ledger)
        acc.close()


def test_a_plan_in_its_fields_parts_dtypes_and_tensor_ids() -> None:
    """A plan's norm, divisor (|S| C) and groups (None without group ids); each Part in the loss's dtype, its weight
    int64 (float64 where C makes it fractional); sequence ids given as tensors (a sequence split over two
    microbatches counted once); a ledger divided by a divisor off by 1e-10 refused."""
    lays = [Layout(torch.tensor([[1, 1, 0], [1, 0, 0]]), seq_ids=torch.tensor([[7, 8]])),
            Layout(torch.tensor([[1, 1, 1]]), seq_ids=torch.tensor([8]))]
    losses = [torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]]), torch.tensor([[8.0, 16.0, 32.0]])]
    plan = plan_window("seq-mean-token-sum-norm", lays, norm=2.5)
    assert (plan.norm, plan.sequences, plan.divisor, plan.groups) == (2.5, 2, 5.0, None)
    for dtype in (torch.float32, torch.float64):
        parts = [plan.part(k, loss.to(dtype)) for k, loss in enumerate(losses)]
        assert [p.loss.dtype for p in parts] == [dtype, dtype]
        assert [p.weight.dtype for p in parts] == [torch.float64, torch.float64]
        assert [float(p.loss) for p in parts] == [7.0, 56.0] and [float(p.weight) for p in parts] == [5.0, 0.0]
    token = plan_window("token-mean", lays)
    assert (token.norm, token.groups, token.tokens, token.divisor) == (None, None, 6, 6)
    part = token.part(0, losses[0].float())
    assert (part.loss.dtype, part.weight.dtype, int(part.weight)) == (torch.float32, torch.int64, 3)
    from types import SimpleNamespace

    for off, refused in ((0.0, False), (1e-13, False), (1e-10, True)):
        ledger = SimpleNamespace(microbatches_global=2, divisor=5.0 * (1 + off), weighting="weighted")
        if refused:
            with pytest.raises(GradaggError, match="the plan counted 5.0"):
                plan.check(ledger)
        else:
            plan.check(ledger)


def test_the_reference_takes_a_positive_finite_norm_only() -> None:
    """modes_reference's seq-mean-token-sum-norm: a norm below 1 is a norm (sum over |S| C), none, 0, a negative or
    an infinite one is refused as such."""
    seqs = [ref.Seq([1.0, 3.0], [True, True]), ref.Seq([5.0, 9.0], [True, False])]
    assert ref.aggregate("seq-mean-token-sum-norm", seqs, norm=0.5) == (1.0 + 3.0 + 5.0) / (2 * 0.5)
    for bad in (None, 0.0, -2.0, math.inf, math.nan):
        with pytest.raises(GradaggError, match="needs a declared positive constant norm, got"):
            ref.aggregate("seq-mean-token-sum-norm", seqs, norm=bad)


def test_plan_and_microbatch_go_together_and_a_planned_mask_may_be_0_1() -> None:
    """aggregate/token_mean with a plan: plan= and microbatch= both or neither; a microbatch one past the plan
    refused as such; the planned mask given as 0/1 numbers is the same mask; as you go, refusals name the mode;
    a norm below 1 is a norm."""
    lay = Layout(torch.tensor([[1, 1, 0]]))
    plan = plan_window("token-mean", [lay])
    loss = torch.tensor([[1.0, 2.0, 4.0]])
    with pytest.raises(GradaggError, match="give plan= and microbatch= together"):
        aggregate("token-mean", loss, lay.mask, plan=plan)
    with pytest.raises(GradaggError, match="give plan= and microbatch= together"):
        aggregate("token-mean", loss, lay.mask, microbatch=0)
    with pytest.raises(GradaggError, match="give plan= and microbatch= together"):
        token_mean(loss, lay.mask, microbatch=0)
    with pytest.raises(GradaggError, match="microbatch 1 is not among this rank's 1"):
        aggregate("token-mean", loss, lay.mask, plan=plan, microbatch=1)
    for mask in (lay.mask, lay.mask.bool(), lay.mask.float()):
        part = aggregate("token-mean", loss, mask, plan=plan, microbatch=0)
        assert (float(part.loss), int(part.weight)) == (3.0, 2), mask
    with pytest.raises(GradaggError, match=r"^token-mean: mask\[0, 2\] is 2"):
        token_mean(loss, torch.tensor([[1, 1, 2]]))
    with pytest.raises(GradaggError, match="^token-mean: the token loss has shape"):
        token_mean(torch.ones(1, 2), lay.mask)
    part = seq_mean_token_sum_norm(loss, lay.mask, norm=0.5)
    assert (float(part.loss), float(part.weight)) == (3.0, 0.5)
