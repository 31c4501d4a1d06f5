"""Global norms of a small MoE with experts sharded by DTensor, on 2 and 4 gloo ranks, against one process.

The model and the step are in ``tests.torch.workers.moe`` (experts ``Shard(0)`` on an "ep" mesh, a head ``Replicate()``
on "dp", a plain router and a tied plain embedding; float64). Each world runs the sharded step, checks its
gradients against the one-process full batch, then computes gradagg's norm (from ``Ownership.from_module``
and from the placements alone), the known wrong answers, and a clip.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import moe as w

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}
# float64. The distributed norm adds the same ~150 squares as one process, in another order (per rank, then
# across ranks): each addition rounds by at most 2**-53 relative, so ~2e-14 at worst.
NORM_REL = 1e-13
# Gradients (|g| < 200) are sums of the same per-token terms in another order: a few ulps of 200.
GRAD_ABS = 1e-12


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_local_world(w.two_rank_world, 2, **WORLD)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_local_world(w.four_rank_world, 4, **WORLD)


def _runs(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each configuration's per-rank results: mesh (1, 2) with 5 experts; (2, 2) with 5; (1, 4) with 3."""
    return {
        "dp1_ep2": [r["moe"] for r in two],
        "dp2_ep2": [r["dp2_ep2"] for r in four],
        "ep4_uneven": [r["ep4_uneven"] for r in four],
    }


def test_sharded_step_matches_one_process_gradients(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """The test's own premise: the sharded step's gradients (full_tensor of each DTensor) are the full batch's."""
    for config, ranks in _runs(two, four).items():
        for r in ranks:
            assert r["grad_error"] <= GRAD_ABS, config


def test_norm_equals_one_process_norm(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """gradagg's norm, from Ownership.from_module and from the placements alone, equals torch's one-process
    norm of the same model (69.2 for 5 experts, 91.3 for 3), with the same bits on every rank."""
    for config, ranks in _runs(two, four).items():
        bits = {r["declared"] for r in ranks} | {r["placements"] for r in ranks}
        assert len(bits) == 1, (config, bits)
        assert float.fromhex(bits.pop()) == pytest.approx(ranks[0]["truth"], rel=NORM_REL), config


def test_one_scalar_collective(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """Experts on "ep", head on "dp", plain router: one all_reduce per norm in all (fewer than one per mesh);
    from_module compares and gathers the ranks' placements once (two all_gather_object)."""
    for config, ranks in _runs(two, four).items():
        for r in ranks:
            assert r["declared_collectives"] == r["placements_collectives"] == {"all_reduce(sum)": 1}, config
            assert r["from_module"] == {"all_gather_object": 2}, config


def test_known_wrong_answers_differ(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """Averaging the per-rank norms (DeepSpeed #8469), counting every rank's replica, and leaving the experts
    out (DeepSpeed #8613) each miss the one-process norm by more than 1%; gradagg is within NORM_REL."""
    for config, ranks in _runs(two, four).items():
        truth = ranks[0]["truth"]
        for name, value in ranks[0]["wrong"].items():
            assert abs(value - truth) > 0.01 * truth, (config, name, value, truth)


def test_deepspeed_8469_numbers(two: list[dict[str, Any]]) -> None:
    """Expert gradients 2, 4, 6, 8 in a (4, 1) weight, Shard(0) over 2 ranks: the norm is sqrt(4 + 16 + 36 + 64)
    = sqrt(120) = 10.954 on both ranks; averaging the per-rank norms gives (sqrt(20) + sqrt(100)) / 2 = 7.236."""
    for r in two:
        assert r["deepspeed"]["gradagg"] == pytest.approx(math.sqrt(120), rel=1e-15)  # 4 exact squares, one sqrt
        assert r["deepspeed"]["average_of_rank_norms"] == pytest.approx((math.sqrt(20) + 10) / 2, rel=1e-15)
        assert (
            round(r["deepspeed"]["gradagg"], 2) == 10.95 and round(r["deepspeed"]["average_of_rank_norms"], 2) == 7.24
        )


def test_owners_from_placements(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """Plain parameters (both names of the tied embedding included) and the replicated head: one shard, rank 0.
    Experts: one shard per "ep" coordinate, owned by the rank at that coordinate in the mesh copy that holds
    rank 0 (on the (2, 2) mesh ranks 2 and 3 hold copies and own nothing); 3 experts over 4 ranks: rank 3's
    shard is empty and still declared."""
    dense = {n: ((3, 3), 0) for n in ("embed.weight", "unembed.weight")} | {"head": ((3,), 0)}
    five = dense | {"router.weight": ((5, 3), 0), "router.bias": ((5,), 0)}
    for e, (rows, rank) in enumerate([(3, 0), (2, 1)]):
        five |= {f"experts.w_in[ep={e}]": ((rows, 3, 4), rank), f"experts.w_out[ep={e}]": ((rows, 4, 3), rank)}
    three = dense | {"router.weight": ((3, 3), 0), "router.bias": ((3,), 0)}
    for e, rows in enumerate([1, 1, 1, 0]):
        three |= {f"experts.w_in[ep={e}]": ((rows, 3, 4), e), f"experts.w_out[ep={e}]": ((rows, 4, 3), e)}
    want = {"dp1_ep2": five, "dp2_ep2": five, "ep4_uneven": three}
    for config, ranks in _runs(two, four).items():
        for r in ranks:
            assert r["owners"] == want[config], config


def test_clipping_scales_identically(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """Clip to half the norm: every rank returns the same norm bits, the clipped gradients equal torch's clip of
    the one-process model, replicated gradients keep identical bits on every rank, and copies of an expert
    shard (ranks 0 and 2, 1 and 3 on the (2, 2) mesh) stay identical."""
    for config, ranks in _runs(two, four).items():
        assert len({r["clip"]["norm"] for r in ranks}) == 1, config
        for r in ranks:
            assert r["clip"]["error"] <= GRAD_ABS, config
        for name in ("embed.weight", "router.weight", "router.bias", "head"):
            assert all(r["clip"]["local"][name] == ranks[0]["clip"]["local"][name] for r in ranks), (config, name)
    dp2 = _runs(two, four)["dp2_ep2"]
    for a, b in ((0, 2), (1, 3)):
        assert dp2[a]["clip"]["local"]["experts.w_in"] == dp2[b]["clip"]["local"]["experts.w_in"]


def test_partial_gradient_refused_on_every_rank(two: list[dict[str, Any]]) -> None:
    """Rank 1's expert gradient is Partial (left unreduced): rank 1 raises PlacementError naming the parameter
    and the placement, rank 0 CollectiveError naming rank 1, declared or not; nobody waits for a timeout."""
    for key in ("partial_grad", "partial_grad_undeclared"):
        kind0, message0 = two[0]["refusals"][key]
        kind1, message1 = two[1]["refusals"][key]
        assert kind0 == "CollectiveError" and "rank(s) [1]" in message0, key
        assert kind1 == "PlacementError" and "Partial(sum)" in message1 and "rank 1" in message1, key
    assert "'experts.w_in'" in two[1]["refusals"]["partial_grad"][1]
    assert "shape (5, 3, 4)" in two[1]["refusals"]["partial_grad_undeclared"][1]


def test_from_module_refusals_on_every_rank(two: list[dict[str, Any]]) -> None:
    """Rank 1 replicates experts.w_in where rank 0 shards it: CollectiveError on both naming both placements.
    A Partial parameter: PlacementError on both ranks."""
    for r in two:
        kind, message = r["refusals"]["placement_differs"]
        assert kind == "CollectiveError" and "'experts.w_in'" in message
        assert "Shard(dim=0)" in message and "Replicate()" in message and "rank 1 declared" in message
        kind, message = r["refusals"]["partial_param"]
        assert kind == "PlacementError" and "Partial(sum)" in message and "'w'" in message
