"""gradagg.torch on real process groups: 2 to 4 gloo ranks on loopback, each world started by forkserver.

The worker functions live in ``tests.torch.workers.dist`` (importable by the ranks); each
world runs several checks and returns plain values, asserted here. Each module
fixture starts one world, so a failure names the world and the rank.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gradagg.mutants import OWNER_SUM_MUTANTS
from gradagg.testing import launch_local_world, run_local_world
from tests.torch.workers import dist as w

COLLECTIVE_TIMEOUT_S = 5.0  # short: a dead or stalled peer must become an error within seconds
# One set of options for every world of this test process: the fork server starts once, with these.
WORLD: dict[str, Any] = {"collective_timeout_s": COLLECTIVE_TIMEOUT_S, "timeout_s": 120.0, "preload": ["torch._dynamo"]}
# float64 throughout. The accumulator sums per-microbatch gradients, then across ranks, then divides
# by M; the full batch sums per sample inside one backward. Same terms, different order: each of the
# <= 32 additions rounds by at most 2**-53 relative, with |gradients| < 10: well under 1e-12.
TOL = 1e-12


@pytest.fixture(scope="module")
def uneven() -> list[dict[str, Any]]:
    return run_local_world(w.accumulation_world, 2, [3, 5], **WORLD)


def test_uneven_counts_match_full_batch(uneven: list[dict[str, Any]]) -> None:
    """Ranks run 3 and 5 microbatches: every .grad equals the full-batch gradient of all 8 (M = 8, not 3 or 5)."""
    for r in uneven:
        assert r["max_error"] <= TOL, r["max_error"]
        assert r["ledger"].microbatches_per_rank == (3, 5)
        assert r["ledger"].divisor == 8


def test_absent_parameters(uneven: list[dict[str, Any]]) -> None:
    """experts.2 is absent from all of rank 0's microbatches yet gets the global mean there (checked by
    max_error); ``unused`` is absent everywhere and stays None on both ranks."""
    for r in uneven:
        assert r["none"] == ["unused.bias", "unused.weight"]
        assert r["ledger"].participation_global["experts.2.weight"] == 4
    assert uneven[0]["ledger"].participation_local["experts.2.weight"] == 0
    assert "divisor M = 8" in uneven[0]["report"]


def test_one_collective_per_finish(uneven: list[dict[str, Any]]) -> None:
    """Gradients, M per rank, participation and status travel in one all_reduce; building an accumulator
    also compares the ranks' parameter lists (one all_gather_object of a digest)."""
    for r in uneven:
        assert r["collectives"] == {"all_reduce(sum)": 1}
        assert r["first_collectives"] == {"all_gather_object": 1, "all_reduce(sum)": 1}


def test_different_parameter_lists_refused_on_every_rank() -> None:
    """Rank 1's model has an extra layer: both ranks raise CollectiveError naming extra.weight, before data moves."""
    for r in run_local_world(w.layout_mismatch_world, 2, **WORLD):
        kind, message = r["error"]
        assert kind == "CollectiveError" and "'extra.weight'" in message and "rank 1 declared" in message


def test_known_wrong_fixes_are_visibly_wrong(uneven: list[dict[str, Any]]) -> None:
    """Dividing by participation, or by the local count then the world size (DDP), misses by > 0.01."""
    for r in uneven:
        assert r["wrong_participation"] > 0.01
        assert r["wrong_world_size"] > 0.01


def test_ddp_wrapped_module_gives_the_same_result() -> None:
    """DDP-wrapped model, counts 3 and 5, forward inside or outside microbatch(): bit-identical to the plain
    module, and DDP sends nothing (with uneven counts its own all_reduce would mismatch or hang): gradagg's
    window sends its one all_reduce (the layout check ran when the accumulator was built)."""
    for r in run_local_world(w.ddp_world, 2, [3, 5], **WORLD):
        for where in ("inside", "outside"):
            assert r[where] == {"diff": 0.0, "collectives": 1}


@pytest.fixture(scope="module")
def failures() -> list[dict[str, Any]]:
    return run_local_world(w.window_failures_world, 2, **WORLD)


def test_poisoned_window_refused_on_every_rank(failures: list[dict[str, Any]]) -> None:
    """Rank 1's microbatch raises after backward: both ranks' finish() raise WindowError naming rank 1;
    after discard() a clean window of 2 + 2 microbatches equals the full batch of 4."""
    for r in failures:
        kind, message = r["poisoned"]
        assert kind == "WindowError" and "rank 1 poisoned" in message
        assert r["after_discard"] <= TOL
    assert "injected failure" in failures[1]["poisoned"][1]


def test_zero_microbatches(failures: list[dict[str, Any]]) -> None:
    """M = 0 on every rank: WindowError on both. Counts 0 and 2: rank 0 contributes zeros, M = 2."""
    for r in failures:
        assert r["m_zero"][0] == "WindowError" and "M = 0" in r["m_zero"][1]
        assert r["one_rank_empty"] <= TOL
        assert r["one_rank_empty_m"] == (0, 2)


def test_stale_gradients_refused_on_every_rank(failures: list[dict[str, Any]]) -> None:
    """Rank 0 ran no microbatch but kept gradients from before: both ranks refuse, naming rank 0. A second
    finish() right after one: both refuse (the gradients of the first are still there: stale on every rank)."""
    for r in failures:
        assert r["stale"][0] == "WindowError" and "rank 0 had gradients" in r["stale"][1]
        assert r["second_finish"][0] == "WindowError" and "rank 0 had gradients" in r["second_finish"][1]


def test_gradients_kept_from_a_window_are_not_overwritten(failures: list[dict[str, Any]]) -> None:
    """A .grad tensor kept after finish() still holds its values after the next window: the flat buffer
    is only reused once no view of it is alive."""
    for r in failures:
        assert r["kept_intact"]


def test_nan_on_one_rank_same_decision_everywhere() -> None:
    """A NaN input on rank 1 makes the same parameters NaN on both ranks (same bits elsewhere); the norm is
    NaN on both; clip(error_if_nonfinite) and nonfinite="raise" raise on both, naming rank 1."""
    results = run_local_world(w.nonfinite_world, 2, **WORLD)
    assert results[0]["nan_params"] == results[1]["nan_params"] != []
    for r in results:
        assert r["identical"] and r["norm_is_nan"]
        assert r["clip_raises"][0] == "NonFiniteGradientError"
        assert r["raise_mode"][0] == "NonFiniteGradientError" and "rank(s) [1]" in r["raise_mode"][1]


@pytest.fixture(scope="module")
def owner_results() -> list[dict[str, Any]]:
    return run_local_world(w.owner_reduce_world, 4, **WORLD)


def test_owner_reduce_matches_reference_on_case_fixtures(owner_results: list[dict[str, Any]]) -> None:
    """The six case fixtures, workers a, b, c, q on ranks 0-3: e.g. shard x = 1 (owner a), not 1 + 9.
    Each known wrong fix (sum every replica, keep the first replica) disagrees on some fixture."""
    for r in owner_results:
        for label, (got, want) in r["cases"].items():
            assert got == want, label
    for name, mutant in OWNER_SUM_MUTANTS.items():
        wrong = [
            label for label, rows in w.CASE_FIXTURES.items() if mutant(rows) != owner_results[0]["cases"][label][0]
        ]
        assert wrong, f"{name} is not caught"


def test_owner_reduce_matches_reference_on_seeded_rows(owner_results: list[dict[str, Any]]) -> None:
    """Seed 7, 12 vector shards, stale replicas (one NaN), owners balanced or all on rank 0, through each
    collective: bit-equal to reference.owner_sum; one collective per call after the once-per-declaration
    verification (one all_gather_object). On gloo "auto" picks the all_reduce (see gradagg.torch.reduce)."""
    for r in owner_results:
        for (skew, collective), got in r["random"].items():
            assert got["equal"] and got["held_intact"], (skew, collective)
            op = "all_gather" if collective == "all_gather" else "all_reduce(sum)"
            assert got["steady"] == {op: 1}, (skew, collective)
            assert got["first"] == {"all_gather_object": 1, op: 1}, (skew, collective)


def test_each_ownership_mismatch_detected_on_every_rank() -> None:
    """Rank 2 declares shard w with another shape, dtype or owner, leaves it out, or adds one: all 4 ranks
    raise CollectiveError naming ranks 0 and 2 and both declarations; a consistent declaration then works."""
    results = run_local_world(w.mismatch_world, 4, **WORLD)
    for r in results:
        for kind in w.MISMATCHES:
            name, message = r[kind]
            assert name == "CollectiveError", kind
            assert "rank 0 declared" in message and "rank 2 declared" in message, message
        assert "shape=(2, 2)" in r["shape"][1] and "dtype=float64" in r["dtype"][1] and "owner=1" in r["owner"][1]
        assert r["good"] == {"b": [1.0, 1.0, 1.0], "w": [[1.0] * 3] * 2}
        assert r["owner_out_of_group"][0] == "CollectiveError" and "owner rank 9" in r["owner_out_of_group"][1]


def test_grad_norm_counts_each_parameter_once() -> None:
    """4 ranks: replicated grad ones(4) owned by rank 0 (norm^2 4, tied copy not counted again) plus rank r's
    expert grad r + 1: norm = sqrt(4 + 1 + 4 + 9 + 16) = sqrt(34) on every rank, in one scalar all_reduce.
    Undeclared (ownership=None): rank 0's copy only, norm 2. Clipping to 1 scales by 1 / (sqrt(34) + 1e-6)."""
    for r in run_local_world(w.norm_world, 4, **WORLD):
        assert r["norm"] == pytest.approx(math.sqrt(34), rel=1e-6)  # float32 gradients
        assert r["collectives"] == {"all_reduce(sum)": 1}
        assert r["replicated_only"] == 2.0
        assert r["rep_after_clip"] == pytest.approx([1 / (math.sqrt(34) + 1e-6)] * 4, rel=1e-6)


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_dead_or_stalled_rank_raises_instead_of_hanging(mode: str) -> None:
    """Rank 1 exits (or sleeps past the timeout) after its first microbatch: rank 0's finish() raises
    CollectiveError within the collective timeout plus 5 s, naming the operation."""
    timeout_s = 2.0  # shorter still than the other worlds': this test waits for it
    outcomes = launch_local_world(w.dying_world, 2, mode, timeout_s, **{**WORLD, "collective_timeout_s": timeout_s})
    r0 = outcomes[0]
    assert r0.ok, r0.error
    assert r0.value["error"] == "CollectiveError", r0.value
    assert "all_reduce" in r0.value["message"]
    assert r0.value["elapsed"] < timeout_s + 5.0
    assert not outcomes[1].ok


def test_failing_rank_is_reported_by_rank() -> None:
    """A worker that raises on rank 1 makes run_local_world raise CollectiveError naming rank 1 and the error."""
    from gradagg.errors import CollectiveError

    with pytest.raises(CollectiveError, match=r"rank 1: ValueError: rank one is broken on purpose"):
        run_local_world(w.failing_world, 2, **WORLD)


def test_unpicklable_result_is_reported() -> None:
    """A worker whose return value cannot be pickled is reported with the pickling error, per rank."""
    from gradagg.errors import CollectiveError

    with pytest.raises(CollectiveError, match=r"2 of 2 ranks failed.*rank 0: .*(?i:pickl)"):
        run_local_world(w.unpicklable_world, 2, **WORLD)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs 2 CUDA GPUs; none here"
)
def test_nccl_uneven_counts_match_full_batch() -> None:
    """Same as the gloo check, on NCCL: the flat buffer and counters live on the current CUDA device."""
    results = run_local_world(w.accumulation_world_cuda, 2, [3, 5], backend="nccl", **WORLD)
    for r in results:
        assert r["max_error"] <= TOL
