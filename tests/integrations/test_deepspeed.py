"""gradagg.integrations.deepspeed on 2 gloo ranks, ZeRO stages 1, 2 and 3, against the float64 one-process truth.

One world runs every case (DeepSpeed imports slowly): a tiny token model, float32, torch's SGD (lr 1: the
applied gradient is the parameters' change), three windows with token counts that differ per microbatch and
microbatch counts that differ per rank (3+1, 0+2, the short 1+1; ZeRO-3 padded with weight-0 microbatches),
with and without DeepSpeed's gradient clipping; DeepSpeed's own recipe beside it; a seeded random plan per stage.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed==0.19.8 to run these)")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import deepspeed_zero as dz  # noqa: E402

# float32 round-off: each gradient element sums a few dozen float32 token terms, scaled once by world / D and
# averaged over 2 ranks in float32, read back as the change of float32 parameters; observed relative errors
# stay below 1e-6, and DeepSpeed's own recipe is off by more than 40%.
TOLERANCE = 1e-5
CLIP = 0.6  # between the windows' true gradient norms (asserted): some steps clipped, some not (a gradient scaled
# wrongly would hide behind a clip that always acts: its direction is right)
STAGES = (1, 2, 3)
SEED = int(os.environ.get("GRADAGG_FUZZ_SEED", random.randrange(2**31)))
CASES = ([("exact", s, c, 0) for s in STAGES for c in (0.0, CLIP)] + [("native", s, 0.0, 0) for s in STAGES]
         + [("fuzz", s, 0.0, SEED + s) for s in STAGES])


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_local_world(dz.deepspeed_world, 2, CASES, timeout_s=400.0, collective_timeout_s=60.0,
                           env={"DS_ACCELERATOR": "cpu"}, preload=["torch._dynamo"])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("clip", [0.0, CLIP])
def test_every_step_applies_the_global_token_mean(world: list[dict[str, Any]], stage: int, clip: float) -> None:
    """Uneven counts (a rank with none, the short last window), a parameter absent on one rank: exact on both
    ranks, one optimizer step per window, D = the window's tokens; clipped as DeepSpeed clips the exact gradient."""
    for r in world:
        case = r[f"exact/{stage}/{clip}"]
        assert max(case["errors"]) < TOLERANCE, case["errors"]
        assert case["global_steps"] == 3 and case["divisors"] == [16.0, 10.0, 7.0], case
        if clip:
            assert min(case["true_norms"]) < clip < max(case["true_norms"]), case["true_norms"]


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeeds_own_recipe_is_not_the_token_mean(world: list[dict[str, Any]], stage: int) -> None:
    """engine.backward(mean loss), gradient_accumulation_steps 3, even counts: the mean of microbatch means
    divided by 3 (the short window of 2 too). The README's table reads these errors."""
    errors = world[0][f"native/{stage}/0.0"]["errors"]
    print(f"DeepSpeed's own recipe, ZeRO-{stage}: relative errors per window {[round(e, 3) for e in errors]}")
    assert min(errors) > 0.4, errors


@pytest.mark.parametrize("stage", STAGES)
def test_random_plans_are_exact(world: list[dict[str, Any]], stage: int) -> None:
    """Seeded random windows (0-3 microbatches per rank, 0-6 tokens each), unclipped (a clip that acts would
    hide a wrong scale); rerun one with GRADAGG_FUZZ_SEED=<seed>."""
    print(f"seed {SEED + stage}: plan {dz.random_plan(SEED + stage)}")
    for r in world:
        case = r[f"fuzz/{stage}/0.0"]
        assert max(case["errors"]) < TOLERANCE, (SEED + stage, case["errors"])
        assert case["global_steps"] == 4, case


def test_unsupported_engines_are_refused_at_exact(world: list[dict[str, Any]]) -> None:
    """ZeRO stage 0 and gradient_accumulation_steps 3: a GradaggError naming the stage or the setting."""
    for r in world:
        assert r["stage0"][0] == "GradaggError" and "ZeRO stage 0" in r["stage0"][1], r["stage0"]
        assert r["steps3"][0] == "GradaggError" and "gradient_accumulation_steps is 3" in r["steps3"][1], r["steps3"]


def test_a_bad_weight_on_one_rank_raises_on_every_rank(world: list[dict[str, Any]]) -> None:
    """weight=NaN on rank 0 only: both ranks raise WindowError naming rank 0, no step is taken, and the next
    window is exact."""
    for r in world:
        kind, message = r["nan_weight"]
        assert kind == "WindowError" and "rank 0 had an invalid" in message, message
        assert r["steps_after_refusal"] == 0 and r["after_refusal_error"] < TOLERANCE, r
        assert r["closed"]
    assert "nan" in world[0]["nan_weight"][1]  # the rank that gave the weight names it


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("outside", "rank 1 poisoned (a backward ran outside microbatch()"),
        ("raised", "rank 1 poisoned (a microbatch raised"),
        ("mixed", "weighted and unweighted microbatches mixed (1 of 2 weighted)"),
        ("zero", "the total weight is 0.0"),
        ("empty", "no microbatch ran on any rank"),
    ],
)
def test_a_refused_window_raises_on_every_rank(world: list[dict[str, Any]], case: str, fragment: str) -> None:
    """A window that cannot be counted, on one rank or all: both ranks raise WindowError and no step is taken."""
    for r in world:
        kind, message = r[case]
        assert kind == "WindowError" and fragment in message, message
        assert r["steps_after_poison"] == 0


@pytest.fixture(scope="module", params=STAGES)
def accelerate_world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    pytest.importorskip("accelerate", reason="Accelerate is not installed")
    pytest.importorskip("transformers", reason="Accelerate's DeepSpeed plugin reads transformers' version")
    from tests.integrations.workers import deepspeed_accel

    stage = request.param
    return stage, run_local_world(deepspeed_accel.accelerate_world, 2, stage, ["exact", "line", "native"],
                                  timeout_s=300.0, collective_timeout_s=60.0, env={"DS_ACCELERATOR": "cpu"},
                                  preload=["torch._dynamo"])


def test_accelerate_with_its_deepspeed_plugin_is_exact(accelerate_world: tuple[int, list[dict[str, Any]]]) -> None:
    """A DeepSpeedAccumulator on the engine Accelerate prepared (gradient_accumulation_steps 3 in both):
    accelerator.backward(loss_sum) inside acc.microbatch(weight=tokens) is exact, the short last window included
    (Accelerate calls engine.step() inside the sync microbatch's backward); Accelerate's own recipe is not."""
    stage, results = accelerate_world
    for r in results:
        native = r["native"]
        for exact in (r["exact"], r["line"]):
            assert exact["stage"] == stage and exact["kind"].endswith("DEEPSPEED"), exact
            assert exact["windows"] == [3, 3, 3, 1] and exact["global_steps"] == 4, exact
            assert max(exact["errors"]) < TOLERANCE, exact["errors"]
        assert min(native["errors"]) > 0.4, native["errors"]
    print(f"ZeRO-{stage} under Accelerate, relative errors per window: Accelerate's own recipe "
          f"{[round(e, 3) for e in results[0]['native']['errors']]}, gradagg {results[0]['line']['errors']}")


def test_accelerates_exact_routes_deepspeed(accelerate_world: tuple[int, list[dict[str, Any]]]) -> None:
    """integrations.accelerate.exact(accelerator, engine, optimizer) is the DeepSpeedAccumulator on the engine; a
    model that is not the engine, and DDP's options, are refused naming what was given."""
    _, results = accelerate_world
    for r in results:
        assert r["line"]["type"] == "DeepSpeedAccumulator", r["line"]
        not_engine, options = r["line"]["refused"]
        assert not_engine.startswith("GradaggError") and "model is a Tiny, not the DeepSpeedEngine" in not_engine
        assert options.startswith("GradaggError") and "options ['bucket_mb']" in options, options
