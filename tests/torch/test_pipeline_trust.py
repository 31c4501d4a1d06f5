"""PipelineAccumulator against a hostile user (issue 22), on 2 gloo ranks: one pipeline of 2 stages.

Workers: tests.torch.workers.pipeline_trust. Counts given in reused tensors; schedules that disagree between
stages; a stage's loss function raising on one microbatch: each exact, or one GradaggError on every rank
within the collective timeout.
"""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import pipeline as pw
from tests.torch.workers import pipeline_trust as pt

TIMEOUT = 5.0  # the world's collective timeout, seconds
WORLD: dict[str, Any] = {"collective_timeout_s": TIMEOUT, "timeout_s": 180.0}
# float64: the oracle's per-token terms summed in another order (per microbatch, per tie), divided by the same
# D: a few ulps of the largest gradient (as tests/torch/test_pipeline.py).
EXACT = 1e-14


@pytest.fixture(scope="module")
def reused() -> list[dict[Any, Any]]:
    return run_local_world(pt.reused_world, 2, **WORLD)


@pytest.mark.parametrize("kind", list(pw.SCHEDULES))
@pytest.mark.parametrize("dtype", list(pt.REUSED))
def test_count_in_a_reused_tensor_is_taken_when_given(reused: list[dict[Any, Any]], kind: str, dtype: str) -> None:
    """The loss returns its count in one tensor overwritten for every microbatch (each dtype, a view, shape
    (1,)): each microbatch counts its own value (6, 4, 10, 3), D = 23 (not 4 x the last count, 12), exact."""
    for r in reused:
        got = r[(kind, dtype)]
        assert got["divisor"] == 23.0, got
        assert got["error"] <= EXACT, got
    assert reused[1][(kind, dtype)]["local"] == (6.0, 4.0, 10.0, 3.0)
