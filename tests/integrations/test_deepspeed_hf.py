"""exact(trainer) on a Hugging Face Trainer with ``deepspeed=`` a ZeRO 1, 2 or 3 config, on 2 gloo ranks, against the
float64 one-process token mean of each window (see :mod:`tests.integrations.workers.deepspeed_hf`).

One world per ZeRO stage (Accelerate takes a DeepSpeed plugin at its first Accelerator only): gradagg's case with
DeepSpeed's clipping (``max_grad_norm``) acting on one window, and the Trainer's own beside it, with its defaults
and with ``average_tokens_across_devices=False``; windows of 3 and the short last one of 2, uneven token counts.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed==0.19.8 to run these)")
pytest.importorskip("transformers", reason="transformers is not installed")

from gradagg.testing import run_local_world  # noqa: E402

# float32 round-off: each gradient element sums a few hundred float32 token terms, is scaled once and averaged
# over 2 ranks in float32, and is read back as the change of float32 parameters of order 1 (the norms' weights):
# observed below 3e-6, the same as the Trainer's own (exact) default under DeepSpeed; its other setting is off by >10%
TOLERANCE = 1e-5
LOG_TOLERANCE = 1e-5  # the logged loss and grad_norm: float32 sums of the same terms
CLIP = 0.6  # between the two windows' true gradient norms (asserted): the second is clipped, the first not
# gradagg; the Trainer's own, two settings; a NaN count on rank 0's second microbatch
CASES = [{"exact": True, "clip": CLIP}, {"avg_tokens": False}, {}, {"bad": {"rank": 0, "at": 2, "value": "nan"}}]


@pytest.fixture(scope="module", params=(1, 2, 3))
def stage_world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    from tests.integrations.workers import deepspeed_hf

    stage = request.param
    results = run_local_world(deepspeed_hf.stage_world, 2, stage, CASES, timeout_s=400.0, collective_timeout_s=60.0,
                              env={"DS_ACCELERATOR": "cpu"}, preload=["torch._dynamo"])
    return stage, results


def test_trainer_with_deepspeed_steps_on_the_global_token_mean(stage_world: tuple[int, list[dict[str, Any]]]) -> None:
    """exact(trainer) under ZeRO-1/2/3: every window's applied gradient is the token mean of both ranks' sequences
    (the short last window too), clipped by DeepSpeed as torch clips; the logged loss and grad_norm are the window's
    token mean and the exact gradient's norm; DeepSpeed's own result beside it is printed."""
    stage, (exact, native, default, _) = stage_world[0], stage_world[1][0]
    assert exact["engine"] == "DeepSpeedEngine" and exact["stage"] == stage, exact
    assert exact["steps"] == 2 and exact["engine_steps"] == 2, exact
    windows = exact["windows"]
    assert [w["sequences"] for w in windows] == [12, 8], windows
    errors = [w["error"] for w in windows]
    print(f"ZeRO-{stage} under the Trainer, relative errors per window: gradagg {errors}, the Trainer's own with "
          f"average_tokens_across_devices=False {[round(w['error'], 3) for w in native['windows']]}, with its "
          f"defaults {[w['error'] for w in default['windows']]}")
    assert max(errors) < TOLERANCE, errors
    assert min(w["norm"] for w in windows) < CLIP < max(w["norm"] for w in windows), windows  # some clipped
    for log, w in zip(exact["logs"], windows, strict=True):
        assert math.isclose(log["loss"], w["loss"], rel_tol=LOG_TOLERANCE), (log, w)
        assert math.isclose(log["grad_norm"], w["norm"], rel_tol=LOG_TOLERANCE), (log, w)
    assert min(w["error"] for w in native["windows"]) > 0.05, native["windows"]


def test_a_bad_count_stops_the_trainer_on_every_rank(stage_world: tuple[int, list[dict[str, Any]]]) -> None:
    """A NaN count on rank 0 only: DeepSpeed's engine.step() of the first window raises on both ranks a WindowError
    naming rank 0 and the step, and no optimizer step is taken."""
    for r in stage_world[1]:
        bad = r[3]
        assert bad["refused"].startswith("WindowError: step 0: exact() could not finish"), bad
        assert "rank 0 had an invalid" in bad["refused"], bad
        assert bad["steps"] == 0 and bad["engine_steps"] == 0, bad
