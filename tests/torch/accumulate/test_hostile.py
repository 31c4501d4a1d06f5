"""Hostile training input on 2 gloo ranks (issue 16): one GradaggError on every rank, naming where, or exact.

Before the fixes: bare tensors in another order mixed gradients silently; weight=1e39 on a float32 model
made every gradient NaN; a float64 overflow of the weights' sum raised OverflowError on one rank while the
other waited out the timeout; a weight or a model on the meta device failed inside a hook or a transfer;
DDP(static_graph=True) failed a PyTorch internal assert; a .grad set by hand was absorbed or lost.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradagg.testing import run_local_world
from tests.torch.workers import hostile

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}


@pytest.fixture(scope="module")
def hostile_results() -> list[dict[str, Any]]:
    return run_local_world(hostile.hostile_world, 2, **WORLD)


def _both(results: list[dict[str, Any]], case: str, kind: str, *fragments: str) -> None:
    for r in results:
        got = r[case]
        assert got is not None and got[0] == kind, (case, r["rank"] if "rank" in r else None, got)
        for fragment in fragments:
            assert fragment in got[1], (case, fragment, got[1])


def test_bare_tensors_in_another_order_are_refused(hostile_results: list[dict[str, Any]]) -> None:
    """[a, b] on rank 0, [b, a] on rank 1: the values differ by position, so both ranks raise before any sum."""
    _both(hostile_results, "reordered", "CollectiveError", "param[0]", "values", "pass (name, tensor) pairs")


def test_indistinguishable_bare_tensors_are_refused(hostile_results: list[dict[str, Any]]) -> None:
    """Two zero tensors of one shape: a reordering could not be seen, so both ranks refuse them as bare tensors."""
    _both(hostile_results, "twins", "GradaggError", "'param[0]' and 'param[1]'", "named_parameters")


def test_a_divisor_beyond_float32_is_refused(hostile_results: list[dict[str, Any]]) -> None:
    """weight=1e39 twice per rank on float32 parameters: D = 4e39 > float32's max; both ranks raise (it was NaN)."""
    _both(hostile_results, "weight_1e39_float32", "WindowError", "4e+39", "float32")


def test_a_large_divisor_within_float32_is_exact(hostile_results: list[dict[str, Any]]) -> None:
    """weight=1e30: the counters travel as float64 bits, D = 4e30 exactly; parameter j's gradient is
    (1 + 2) * (j + 1) * 2 ranks / 4e30 = 1.5 (j + 1) / 1e30, within float32 rounding (2**-23 relative)."""
    for r in hostile_results:
        for j, g in enumerate(r["weight_1e30_float32"]):
            want = 1.5 * (j + 1) / 1e30
            assert torch.allclose(g, torch.full_like(g, want), rtol=2**-22, atol=0), (j, g)


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("weights_overflow_one_rank", "rank 0 had an invalid"),
        ("weights_overflow_over_ranks", "beyond"),
        ("huge_int_weight", "microbatch 0 has weight inf"),
        ("meta_weight", "meta device"),
    ],
)
def test_hostile_weights_raise_on_every_rank(hostile_results: list[dict[str, Any]], case: str, fragment: str) -> None:
    """Each raises WindowError on both ranks at finish() (no timeout: the message is not a CollectiveError);
    the rank that gave the weight names the microbatch."""
    _both(hostile_results, case, "WindowError")
    assert any(fragment in r[case][1] for r in hostile_results), [r[case] for r in hostile_results]


def test_meta_model_and_static_graph_refused_up_front(hostile_results: list[dict[str, Any]]) -> None:
    """Construction raises on both ranks, naming the parameter (meta) or the option (static_graph)."""
    _both(hostile_results, "meta_model", "GradaggError", "'weight'", "meta device")
    _both(hostile_results, "static_graph", "GradaggError", "static_graph", "no_sync")


def test_grad_set_between_microbatches_refused_on_every_rank(hostile_results: list[dict[str, Any]]) -> None:
    """Rank 1 sets p.grad between its microbatches: no microbatch counts it; both ranks refuse, naming rank 1."""
    _both(hostile_results, "set_between", "WindowError", "rank 1 had a .grad set by hand")


def test_grad_set_on_an_fsdp2_shard_refused_on_every_rank(hostile_results: list[dict[str, Any]]) -> None:
    """A .grad set on a sharded DTensor inside a window cannot join the unsharded sum; under every_microbatch one
    set on the unsharded parameter after FSDP reduced it would be absorbed by a later backward: both ranks refuse."""
    _both(hostile_results, "set_on_shard", "WindowError", "rank 1 had a .grad set by hand")
    _both(hostile_results, "set_after_fsdp_reduced", "WindowError", "rank 1 had a .grad set by hand")


def test_grad_set_inside_a_microbatch_counts_there(hostile_results: list[dict[str, Any]]) -> None:
    """Set before the backward (autograd adds to it) and on a parameter no backward reaches: the fast accumulator
    equals its twin. a: microbatch k adds 10 (k + 1) + (k + 1); ranks run 2 and 3: sum 11 * (1 + 2 + 1 + 2 + 3)
    = 99 over M = 5. c (rank 1 only): 1 + 2 + 3 = 6 over 5."""
    for r in hostile_results:
        fast, pure = r["inside_fast"], r["inside_pure"]
        assert torch.allclose(fast[0], torch.full((3,), 99 / 5, dtype=torch.float64), rtol=1e-15, atol=0)
        assert torch.allclose(fast[1], torch.full((3,), 6 / 5, dtype=torch.float64), rtol=1e-15, atol=0)
        assert all(torch.equal(f, p) for f, p in zip(fast, pure))


def test_an_invalid_count_ahead_raises_on_every_rank(hostile_results: list[dict[str, Any]]) -> None:
    """divisors(): rank 1 gives -1 tokens: rank 1 names the term, rank 0 names rank 1; neither waits a timeout."""
    r0, r1 = (r["divisors_invalid_one_rank"] for r in hostile_results)
    assert r1 is not None and r1[0] == "GradaggError" and "'tokens' has count -1.0" in r1[1], r1
    assert r0 is not None and r0[0] == "GradaggError" and "rank(s) [1] gave an invalid count" in r0[1], r0


def test_bare_tensors_in_any_other_order_are_refused(hostile_results: list[dict[str, Any]]) -> None:
    """Rank 0's order and eight seeded orders of four bare tensors (three of one shape) on rank 1: a
    CollectiveError on both ranks exactly when the order differs from rank 0's; rank 0's order passes."""
    for r in hostile_results:
        outcomes = r["permutations"]
        for moved, error in outcomes:
            assert (error is not None) == moved, (moved, error)
            assert error is None or error[0] == "CollectiveError", error
        assert outcomes[0] == (False, None) and sum(moved for moved, _ in outcomes) >= 6
