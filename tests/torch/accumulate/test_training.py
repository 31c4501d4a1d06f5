"""Real training shapes on gloo worlds: token weights, loss terms, DDP overlap, FSDP2, HSDP, uneven counts.

Each check compares with the one-process full-batch gradient of the same global batch (float64). The
accumulator sums per-microbatch gradients, then across ranks, then divides by D; the full batch sums per
token inside one backward. Same terms in another order: each of the <= 40 additions rounds by at most
2**-53 relative, with |gradients| < 10, so differences stay far below TOL = 1e-12 (seen: ~1e-16).
"""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import launch_local_world, run_local_world
from tests.torch.workers import train as tw

TOL = 1e-12
WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}


@pytest.fixture(scope="module")
def plain() -> list[dict[str, Any]]:
    return run_local_world(tw.plain_world, 2, **WORLD)


def test_weighted_uneven_counts_give_the_token_mean(plain: list[dict[str, Any]]) -> None:
    """Counts 3 and 5, weights = valid tokens (6+2+5 on rank 0, 0+3+6+1+4 on rank 1): D = 27 on both ranks,
    and the gradient is the full-batch token mean, not a mean of microbatch means."""
    for r in plain:
        led = r["uneven"]["ledger"]
        assert r["uneven"]["error"] <= TOL
        assert led.divisor == led.weight_global == 27 and led.weight_per_rank == (13.0, 14.0)
        assert led.microbatches_global == 8 and led.weighting == "weighted"
        assert "divisor D = total weight = 27 (per rank: [13, 14])" in led.report()
    assert plain[0]["uneven"]["ledger"].weight_local == 13.0


def test_weighted_with_a_rank_running_nothing(plain: list[dict[str, Any]]) -> None:
    """Rank 0 runs no microbatch, rank 1 runs 4 (tokens 6, 2, 5, 0): D = 13; rank 0 receives the same mean, its
    ledger weighted with a total weight of 0."""
    for r in plain:
        assert r["zero"]["error"] <= TOL
        assert r["zero"]["ledger"].microbatches_per_rank == (0, 4) and r["zero"]["ledger"].divisor == 13
    idle = plain[0]["zero"]["ledger"]  # the rank that ran nothing counts as weighted, with a total weight of 0
    assert (idle.weighting, idle.weight_local, idle.weight_per_rank, idle.weight_global) == ("weighted", 0.0,
                                                                                              (0.0, 13.0), 13.0)


def test_many_buckets_with_lookahead_match_and_count(plain: list[dict[str, Any]]) -> None:
    """A 13-element bucket cap splits the 10 parameters into several buckets: one all_reduce each, the same on
    both ranks (the early ones sent during the last backward), and the same gradients. The window sends nothing
    else: the ranks' parameter lists were compared at construction."""
    for r in plain:
        b = r["buckets"]
        assert b["error"] <= TOL and b["buckets"] > 2
        assert b["collectives"] == {"all_reduce(sum)": b["buckets"]}


def test_loss_terms_divided_ahead(plain: list[dict[str, Any]]) -> None:
    """Token term by the global tokens (6+2+5+0+3 = 16), aux term by global M = 5: counted ahead in one
    collective; finish() divides by 1 and the ledger records both divisors."""
    for r in plain:
        t = r["terms"]
        assert t["error"] <= TOL
        assert t["divisors"] == {"tokens": 16.0, "microbatches": 5.0}
        assert t["ledger"].divisor == 1 and t["ledger"].terms == {"tokens": 16.0, "microbatches": 5.0}
        assert t["ledger"].weighting == "divided ahead"


def test_mixed_weighting_refused_on_every_rank(plain: list[dict[str, Any]]) -> None:
    """Rank 0 weighted, rank 1 unweighted: both ranks raise WindowError naming both."""
    for r in plain:
        kind, msg = r["mixed"]
        assert kind == "WindowError" and "rank 0 weighted" in msg and "rank 1 unweighted" in msg
        assert ("refused on every rank: ranks counted their microbatches differently (rank 0 weighted; rank 1 "
                "unweighted)") in msg, msg


def test_a_failed_rank_and_mixed_weighting_refused_together_and_until_discard(plain: list[dict[str, Any]]) -> None:
    """Rank 0 set a .grad by hand and weighted, rank 1 did not weight: both reasons on both ranks (no "here" on the
    mixed-weighting refusal alone, see above); a step before discard() refused; finish() again refused, rank 1's
    message naming rank 0 as the one that failed."""
    for r in plain:
        kind, msg = r["failed"]["first"]
        assert kind == "WindowError", (kind, msg)
        assert ("refused on every rank: ranks counted their microbatches differently (rank 0 weighted; rank 1 "
                "unweighted); rank 0 had a .grad set by hand") in msg, msg
        assert r["failed"]["step"] is not None and r["failed"]["step"][0] == "WindowError", r["failed"]["step"]
        assert r["failed"]["again"] is not None and r["failed"]["again"][0] == "WindowError", r["failed"]["again"]
    assert "(here: rank(s) [0] failed in the window)" in plain[1]["failed"]["again"][1], plain[1]["failed"]["again"]
    for r in plain:  # no rank failed by itself: the reasons end the message, before its remedy
        assert "rank 1 unweighted); call discard() on every rank" in r["mixed"][1], r["mixed"]


def test_parameter_unfrozen_after_construction_refused_on_every_rank(plain: list[dict[str, Any]]) -> None:
    """``unused`` frozen when the accumulator was built, unfrozen on rank 1: its gradient would be neither
    reduced nor divided; both ranks refuse, naming rank 1 (and the parameter there)."""
    for r in plain:
        kind, msg = r["unfrozen"]
        assert kind == "WindowError" and "rank 1 accumulates other parameters" in msg
    assert "'unused.weight'" in plain[1]["unfrozen"][1]


@pytest.mark.parametrize("form", ["none", "zeros"])
def test_zero_grad_inside_a_window_drops_nothing(form: str) -> None:
    """optimizer.zero_grad(set_to_none=True or False) before every microbatch (counts 2 and 3): the gradients
    are held by the accumulator until finish(), so all 5 microbatches count: the full-batch gradient, M = 5."""
    for r in run_local_world(tw.zero_grad_world, 2, form, **WORLD):
        assert r["error"] <= TOL and r["m"] == 5


def test_complex_parameters() -> None:
    """A complex128 weight (counts 1 and 2): summed as real and imaginary parts, right on both ranks."""
    for r in run_local_world(tw.complex_world, 2, **WORLD):
        assert r["error"] <= TOL and r["dtype"] == "torch.complex128"


def test_attach_finishes_from_the_optimizer_step() -> None:
    """attach(optimizer): step() runs finish() first; one SGD step (lr 0.5) equals the full-batch step (M = 4)."""
    for r in run_local_world(tw.attach_world, 2, **WORLD):
        assert r["error"] <= TOL and r["divisor"] == 4


def test_ddp_weighted_zero_rank_and_overlap() -> None:
    """DDP kept in no_sync(): a rank with no microbatch (tokens 6, 2, 5, 0 on rank 1: D = 13), and counts 3 and 5
    with several buckets sent during the last backward: the full-batch token mean both times."""
    for r in run_local_world(tw.ddp_world, 2, **WORLD):
        assert r["zero"]["error"] <= TOL and r["zero"]["ledger"].divisor == 13
        assert r["buckets"]["error"] <= TOL and r["buckets"]["ledger"].divisor == 27
        assert r["buckets"]["buckets"] > 2
        assert r["buckets"]["collectives"] == {"all_reduce(sum)": r["buckets"]["buckets"]}


@pytest.fixture(scope="module")
def fsdp() -> list[dict[str, Any]]:
    return run_local_world(tw.fsdp_world, 2, **WORLD)


@pytest.mark.parametrize(("label", "divisor"), [("uneven", 27), ("zero", 13)])
def test_fsdp2_uneven_counts(fsdp: list[dict[str, Any]], label: str, divisor: int) -> None:
    """fully_shard on experts, shared and root; counts 3/5 and 0/4 (the latter in several buckets), two windows
    each (the second with look-ahead, buckets leaving during the last backward): DTensor gradients equal to the
    full-batch token mean; one reduce_scatter per bucket and window, the same on both ranks."""
    for r in fsdp:
        runs = r[label]
        for k, run in enumerate(runs):
            assert run["error"] <= TOL, (label, k)
            assert run["ledger"].divisor == divisor and run["grad_types"] == ["DTensor"]
        buckets = runs[0]["buckets"]
        assert (buckets == 1) == (label == "uneven")
        assert runs[0]["collectives"] == {"reduce_scatter(sum)": buckets}
        assert runs[1]["collectives"] == {"reduce_scatter(sum)": buckets}


def test_fsdp2_participation_reported(fsdp: list[dict[str, Any]]) -> None:
    """Participation comes from hooks on the unsharded parameters: expert 1 runs in 6 of the 8 microbatches
    (every 4th routes to expert 0 only), ``unused`` in none and keeps grad None."""
    led = fsdp[0]["uneven"][0]["ledger"]
    assert led.participation_global["experts.1.weight"] == 6 and led.participation_global["unused.weight"] == 0
    assert led.participation_local["shared.weight"] == 3


def test_fsdp2_every_microbatch_with_zero_weight_padding(fsdp: list[dict[str, Any]]) -> None:
    """The memory-saving form: FSDP reduce-scatters every microbatch; rank 0 pads 3 real microbatches to 5
    with weight-0 ones: D = 27, M = 10 counted, the full-batch token mean."""
    for r in fsdp:
        em = r["every_microbatch"]
        assert em["error"] <= TOL and em["ledger"].divisor == 27 and em["ledger"].microbatches_global == 10


def test_fsdp2_default_form_pads_uneven_counts_itself(fsdp: list[dict[str, Any]]) -> None:
    """The default (shards) form, counts 3/5 and 0/4, look-ahead or bare microbatch() calls, no padding by hand:
    D = 27 (13), the full-batch token mean, on both ranks."""
    for r in fsdp:
        for key, (error, divisor) in r["shards"].items():
            assert error <= TOL and divisor == (27 if key.startswith("[3, 5]") else 13), key


def test_hsdp_uneven_counts() -> None:
    """HSDP, mesh (replicate 2, shard 2), counts 1, 0, 3, 2: D summed over both mesh dimensions (6+2+5+0+3+6
    = 22); one reduce_scatter over the shard group, then one all_reduce over the replicas at the window's end."""
    for r in run_local_world(tw.hsdp_world, 4, **WORLD):
        assert r["error"] <= TOL and r["ledger"].divisor == 22
        assert r["collectives"] == {"reduce_scatter(sum)": 1, "all_reduce(sum)": 1}
        assert r["placements"] == "(Replicate(), Shard(dim=0))"
        assert r["every_microbatch_error"] <= TOL  # padded to 3 each, the replica all-reduce in the last backward
        assert r["shards_error"] <= TOL  # the default form, padded by gradagg


def test_rank_dying_inside_an_fsdp2_window() -> None:
    """Rank 1 exits after one microbatch of an FSDP2 window: rank 0's finish() raises CollectiveError within the
    collective timeout plus 5 s."""
    timeout_s = 2.0
    outcomes = launch_local_world(tw.fsdp_dying_world, 2, timeout_s, **{**WORLD, "collective_timeout_s": timeout_s})
    r0 = outcomes[0]
    assert r0.ok, r0.error
    assert r0.value["error"] == "CollectiveError", r0.value
    assert r0.value["elapsed"] < timeout_s + 5.0
    assert not outcomes[1].ok
