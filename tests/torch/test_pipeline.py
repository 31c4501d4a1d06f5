"""PipelineAccumulator on 4 gloo ranks (2 stages x 2 replicas), a tiny tied transformer, against one process.

The worker (tests.torch.workers.pipeline) runs every case in one world: GPipe, 1F1B and interleaved 1F1B
(two stages per rank) with uneven counts per replica and per microbatch; a replica padded with count-0
microbatches; a replica running fewer microbatches than the other; torch's own recipe (a token mean per
microbatch, scale_grads, a DP mean), shown wrong; the norm with the tied embedding/head counted once against
the naive double count; a layer present on one replica only; gradients zeroed in place; and steps refused on
every rank (stale gradients, D = 0, counts that cannot count: in the accumulator's words).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradagg.errors import WindowError
from gradagg.testing import run_local_world
from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import pipeline as w

# float64: gradagg's gradients are the oracle's per-token terms summed in another order (per microbatch,
# per replica, per tie), then divided by the same D: a few ulps of the largest gradient.
EXACT = 1e-14
CASES = ["gpipe", "1f1b", "interleaved", "padded", "fewer"]


TIMEOUT = 10.0  # the world's collective timeout, seconds


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_local_world(w.world, 4, collective_timeout_s=TIMEOUT, timeout_s=120.0)


@pytest.mark.parametrize("case", CASES)
def test_step_equals_one_process_token_mean(ranks: list[dict[str, Any]], case: str) -> None:
    """Every stage on every replica holds the float64 full-batch token-mean gradient; the schedule's own
    scale_grads is restored after the step."""
    for r in ranks:
        assert r[case]["error"] <= EXACT, (case, r[case]["error"])
        assert r[case]["scale_restored"] is True


def test_divisor_counted_once_on_the_last_stage(ranks: list[dict[str, Any]]) -> None:
    """D is the labels' count, taken by each replica's last stage only, the same on every rank; the
    shape-inference call of the first step is not counted; padding microbatches are present with count 0."""
    for case in CASES:
        ledgers = [r[case]["ledger"] for r in ranks]
        assert len({(lg.divisor, lg.tokens_per_replica, lg.loss) for lg in ledgers}) == 1, case
        assert [lg.tokens_local is None for lg in ledgers] == [not lg.last for lg in ledgers]
    uneven = ranks[1]["gpipe"]["ledger"]
    assert uneven.tokens_local == (6.0, 4.0, 10.0, 3.0) and uneven.divisor == 44.0
    assert ranks[3]["padded"]["ledger"].tokens_local == (2.0, 9.0, 0.0, 0.0)
    assert ranks[0]["padded"]["ledger"].padding_per_replica == (0, 2)
    assert ranks[0]["fewer"]["ledger"].microbatches_per_replica == (4, 2)
    assert ranks[1]["gpipe"]["ledger"].absent == ("stage1.unused.weight", "stage1.unused.bias")
    assert "divisor D = total weight = 44 (per replica: [23, 21])" in uneven.report()
    # the counts' two small all_reduce, one for the float32 gradients, one for the tie; the schedules compared once
    for r in ranks:
        assert r["gpipe"]["collectives"] == {"all_gather_object": 1, "all_reduce(sum)": 4}, r["gpipe"]["collectives"]
    assert uneven.weight_per_rank == uneven.tokens_per_replica == (23.0, 21.0) and uneven.weighting == "weighted"
    assert (uneven.rank, uneven.pp_rank, uneven.microbatches_global, uneven.weight_global) == (0, 1, 8, 44.0)


def test_parameter_present_on_one_replica_only(ranks: list[dict[str, Any]]) -> None:
    """A layer that runs on replica 0's last stage only: replica 1 sends zeros for it, both end with replica 0's
    contribution over the global D (not over replica 0's tokens), and the ledger does not call it absent."""
    for r in ranks:
        assert r["presence"]["error"] <= EXACT, r["presence"]["error"]
        assert r["presence"]["ledger"].absent == ()
    assert ranks[1]["presence"]["unused_nonzero"] and ranks[3]["presence"]["unused_nonzero"]


def test_gradients_zeroed_in_place_count_as_absent(ranks: list[dict[str, Any]]) -> None:
    """zero_grad(set_to_none=False) before the step: the zeros are no contribution (a non-zero one is refused,
    test_refused_on_every_rank's "stale"); ``unused`` stays None, as after zero_grad()."""
    for r in ranks:
        assert r["zeroed"]["error"] <= EXACT, r["zeroed"]["error"]


def test_schedule_own_scaling_is_wrong_for_token_weighting(ranks: list[dict[str, Any]]) -> None:
    """torch's recipe (mean loss per microbatch, divided by n_microbatches, then by the replicas) weights a
    token of a short microbatch more: off by far more than round-off (over 10% here), what gradagg fixes."""
    for r in ranks:
        assert r["schedule_own"]["error"] > 0.1


def test_norm_counts_tied_weight_once(ranks: list[dict[str, Any]]) -> None:
    """The norm equals the one-process norm (the tie is one tensor there); the naive norm, counting the
    embedding on stage 0 and the head on stage 1, is sqrt(norm^2 + |tied|^2); clipping uses the right one."""
    for r in ranks:
        c = r["gpipe"]
        assert c["norm"] == pytest.approx(c["norm_truth"], rel=1e-13)
        assert c["naive"] == pytest.approx((c["norm_truth"] ** 2 + c["tied_norm"] ** 2) ** 0.5, rel=1e-13)
        assert c["naive"] - c["norm"] > 0.05
        assert c["clip_before"] == c["norm"] and c["clip_error"] <= EXACT
    assert len({r["gpipe"]["norm"] for r in ranks}) == 1


@pytest.mark.parametrize("what", ["stale", "zero"])
def test_refused_on_every_rank(ranks: list[dict[str, Any]], what: str) -> None:
    """Gradients before the step (on one rank), or D = 0: WindowError on all four ranks, naming the replica, with
    every gradient set to None (never a silent division)."""
    words = {"stale": "had non-zero gradients before the step", "zero": "total count D is 0"}[what]
    for r in ranks:
        out = r[f"refused_{what}"]
        assert out["raised"] is not None and words in out["raised"]
        assert out["all_none"]


def test_a_stage_forward_failure_reaches_every_rank_of_every_replica(ranks: list[dict[str, Any]]) -> None:
    """Replica 0's stage 0 raises in its forward, its process living on: all four ranks raise a WindowError, every
    gradient None. Replica 1, whose step completed, learns of it in the count all-reduce over the data-parallel
    groups, which the failing replica's ranks still join: its ranks name rank 0's cause and rank 1's timed-out
    receive. Rank 1 names its own receive, ended by the collective timeout. Before, replica 1 waited in that
    all-reduce for the data-parallel group's own timeout (torch's default: 30 minutes): the world missed its
    deadline."""
    timed_out = f"Timed out waiting {int(TIMEOUT * 1000)}ms for recv"
    for rank, r in enumerate(ranks):
        got = r["forward_failure"]
        assert got["raised"] is not None and got["raised"][0] == "WindowError", (rank, got)
        message = got["raised"][1]
        if rank != 1:
            assert "(global rank 0)" in message and "caused by ValueError: bad token ids" in message, (rank, got)
        if rank != 0:
            assert "(global rank 1)" in message and timed_out in message, (rank, got)
        assert got["all_none"], (rank, got)


# What the accumulator says of the same weights (the counts of tests.torch.workers.pipeline.BAD_COUNTS).
SAME_WORDS = {
    "nan": "microbatch 0 has weight nan: a weight must be finite and non-negative",
    "negative": "microbatch 2 has weight -3.0: a weight must be finite and non-negative",
    "inf": "microbatch 1 has weight inf: a weight must be finite and non-negative",
    "overflow": "the 4 weights of this rank's window sum beyond float64",
}


def _accumulator_refusal(what: str) -> str:
    """finish()'s message for the window of replica 1's counts (1 standing for each count that can count)."""
    p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    for k in range(4):
        with acc.microbatch(weight=w.BAD_COUNTS[what](k, 1.0)):
            p.sum().backward()
    with pytest.raises(WindowError) as info:
        acc.finish()
    return str(info.value)


@pytest.mark.parametrize("what", list(SAME_WORDS))
def test_count_that_cannot_count_refused_as_the_accumulator_refuses_it(ranks: list[dict[str, Any]], what: str) -> None:
    """A count that is NaN, negative or infinite on replica 1 (or counts that sum beyond float64): WindowError on
    all four ranks, every gradient None, naming the replica's last stage (pipeline rank 1, global rank 3), the
    microbatch and the value in the very words the MicrobatchAccumulator refuses the same weights with."""
    assert SAME_WORDS[what] in _accumulator_refusal(what)
    for r in ranks:
        out = r[f"refused_{what}"]
        assert out["raised"] is not None and out["all_none"], out
        assert SAME_WORDS[what] in out["raised"], out["raised"]
        assert "pipeline rank 1 (global rank 3) of data-parallel replica 1, the loss function's counts" in out["raised"]


def test_replica_counts_beyond_float64_are_refused(ranks: list[dict[str, Any]]) -> None:
    """Each replica's count is finite (1e308 and a few tokens), their sum D is not: refused on every rank (it
    would have divided every gradient to 0)."""
    for r in ranks:
        out = r["refused_beyond"]
        assert out["raised"] is not None and out["all_none"], out
        assert "the total count D over the replicas sums beyond float64" in out["raised"], out["raised"]


def test_a_count_float32_gradients_cannot_be_divided_by_is_refused(ranks: list[dict[str, Any]]) -> None:
    """D = 2e39 and a few tokens: finite in float64, beyond float32, the stages' gradients' dtype, where each gradient
    divided by it would be 0 (torch casts the divisor to the gradient's dtype). Refused on every rank, every gradient
    None, in the words the MicrobatchAccumulator refuses a float32 buffer's divisor with."""
    p = torch.zeros(1, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    for k in range(2):
        with acc.microbatch(weight=1e39 if k == 0 else 1.0):
            p.sum().backward()
    with pytest.raises(WindowError, match="is beyond what float32 sums can be divided by"):
        acc.finish()
    for r in ranks:
        out = r["refused_float32"]
        assert out["raised"] is not None and out["all_none"], out
        assert "the total count D, 2e+39" in out["raised"] and "is beyond what float32 sums can be divided by" in \
            out["raised"], out["raised"]
