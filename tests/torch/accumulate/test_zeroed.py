"""Gradients zeroed in place between windows (``zero_grad(set_to_none=False)``, torchtitan's default) count as
absent; a non-zero leftover is refused on every rank. 2 gloo ranks, workers in ``tests.torch.workers.zeroed``."""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import zeroed as wz

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 180.0, "preload": ["torch._dynamo"]}
SEEDS = [3, 11]
WINDOWS = 5
# float64 both sides, the same per-token terms summed in another order (<= 18 tokens): far below 1e-12.
TOL = 1e-12


@pytest.mark.parametrize("seed", SEEDS)
def test_set_to_none_false_and_true_mixed(seed: int) -> None:
    print(f"seed {seed}")  # noqa: T201  (the plan is drawn from it)
    results = run_local_world(wz.mixed_world, 2, seed, WINDOWS, **WORLD)
    for rank, r in enumerate(results):
        for layout in wz.LAYOUTS:
            case = r[layout]
            assert max(case["errors"]) < TOL, (rank, layout, case)
            for refused in case["refused"]:  # both ranks refuse, naming the holder; it names the parameter
                assert refused is not None and f"rank {case['holder']} had gradients" in refused, (rank, layout, case)
                if rank == case["holder"]:
                    assert "'blocks.0.weight' already has a non-zero gradient" in refused, (layout, refused)
            assert case["after"] < TOL, (rank, layout, case)
    assert any(not none for lay in wz.LAYOUTS for _, none in results[0][lay]["plan"])  # set_to_none=False drawn
