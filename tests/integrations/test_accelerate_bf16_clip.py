"""Accelerate's ``mixed_precision="bf16"`` with ``accelerate.exact`` under ``accelerator.clip_grad_norm_``: the
clipped cell of issue 31's matrix that ``test_accelerate.py`` leaves out (its bf16 world runs unclipped). The same
worker, model and windows (:mod:`tests.integrations.workers.accel`: 2 ranks, windows of 3 and 2 microbatches of
uneven tokens, 2 epochs), one world for gradagg and Accelerate's own recipe under the same switch and clip."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.test_accelerate import BF16_TOLERANCE, CLIP  # noqa: E402
from tests.integrations.workers import accel  # noqa: E402


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    return run_local_world(accel.accelerate_world, 2, [("exact", CLIP), ("native", CLIP)], "bf16", timeout_s=240.0,
                           collective_timeout_s=30.0, preload=["torch._dynamo"])[0]


def test_accelerates_bf16_switch_clipped_is_exact_within_the_round_off(world: dict[str, Any]) -> None:
    """CLIP lies between the steps' true norms (some steps clipped, some not); every clipped step is the float64
    full-batch token mean, clipped by its own norm, within bf16's round-off (BF16_TOLERANCE: autocast's roundings,
    u(bf16) ~ 4e-3 each; seen 0.0029-0.0052); Accelerate's own recipe under the same switch and clip stays off by its
    weighting (seen 0.46-1.1)."""
    ours, native = world[f"exact/{CLIP}"], world[f"native/{CLIP}"]
    assert min(ours["true_norms"]) < CLIP < max(ours["true_norms"]), ours["true_norms"]
    assert len(ours["errors"]) == 4 and max(ours["errors"]) < BF16_TOLERANCE, ours["errors"]
    assert min(ours["errors"]) > 1e-5, ours["errors"]  # bf16's round-off is there: the switch acted
    assert min(native["errors"]) > 0.3, native["errors"]
