"""gradagg.integrations.deepspeed on 2 gloo ranks, ZeRO stages 1, 2 and 3, against the float64 one-process truth.

One world runs every case, part after part (:mod:`tests.integrations.workers.deepspeed_all`: DeepSpeed,
transformers and Accelerate import slowly, and a world per stage paid that again each time):

* raw engines: a tiny token model, float32, torch's SGD (lr 1: the applied gradient is the parameters' change),
  three windows with token counts that differ per microbatch and microbatch counts that differ per rank (3+1,
  0+2, the short 1+1; ZeRO-3 padded with weight-0 microbatches), with and without DeepSpeed's gradient clipping;
  DeepSpeed's own recipe beside it; a seeded random plan per stage; the refusals;
* Accelerate's DeepSpeed plugin, per stage: gradagg's accumulator on the prepared engine, and Accelerate's recipe;
* the Hugging Face Trainer with ``deepspeed=`` a ZeRO config, per stage: ``exact(trainer)`` with DeepSpeed's
  clipping acting on one window, the Trainer's own with ``average_tokens_across_devices=False`` (and with its
  defaults, under ZeRO-2 only: that it is already exact is a figure of the docs, not what gradagg fixes), a NaN
  count on one rank; windows of 3 and the short last one of 2, uneven token counts.

DeepSpeed's shared-memory op is not compiled (see ``deepspeed_zero.no_shared_memory_op``): asserted below.
"""

from __future__ import annotations

import collections
import math
import os
import random
from typing import Any

import pytest

# CI installs all three (requirements-dev.txt); test_deepspeed_refusals.py asserts it there
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -r requirements-dev.txt)")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -r requirements-dev.txt)")
pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -r requirements-dev.txt)")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import deepspeed_all  # noqa: E402
from tests.integrations.workers import deepspeed_steps as ds  # noqa: E402
from tests.integrations.workers import deepspeed_zero as dz  # noqa: E402

# float32 round-off: each gradient element sums a few dozen float32 token terms, scaled once by world / D and
# averaged over 2 ranks in float32, read back as the change of float32 parameters; observed relative errors
# stay below 1e-6, and DeepSpeed's own recipe is off by more than 40%. The Trainer's tiny Llama sums a few hundred
# terms per element, observed below 3e-6 (the Trainer's own default is no closer); its logged loss and grad_norm
# are float32 sums of the same terms.
TOLERANCE = 1e-5
CLIP = 0.6  # between the windows' true gradient norms (asserted): some steps clipped, some not (a gradient scaled
# wrongly would hide behind a clip that always acts: its direction is right)
STAGES = (1, 2, 3)
SEED = int(os.environ.get("GRADAGG_FUZZ_SEED", random.randrange(2**31)))
CASES = ([("exact", s, c, 0) for s in STAGES for c in (0.0, CLIP)] + [("native", s, 0.0, 0) for s in STAGES]
         + [("fuzz", s, 0.0, SEED + s) for s in STAGES])
LOOPS = ["exact", "line", "native"]  # under Accelerate, see deepspeed_accel.accelerate_world
TRAINER = {"exact": {"exact": True, "clip": CLIP}, "avg_tokens": {"avg_tokens": False}, "defaults": {},
           "bad": {"bad": {"rank": 0, "at": 2, "value": "nan"}}}  # a NaN count on rank 0's second microbatch
# "auto" in the Trainer's config, filled by TrainingArguments: k 1, 2 and 4 over the stages (3 is "exact"'s)
AUTO_K = dict(zip(STAGES, random.Random(SEED).sample([1, 2, 4], 3), strict=True))
TRAINER_STAGES = {s: [n for n in TRAINER if n != "defaults" or s == 2] + ["auto"] for s in STAGES}
STEPS = ds.sample(SEED), list(STAGES)  # configs as users write them; DeepSpeed's own loop under exact, per stage


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    trainer = {s: [TRAINER[n] if n != "auto" else {"exact": True, "window": AUTO_K[s]} for n in names]
               for s, names in TRAINER_STAGES.items()}
    results = run_local_world(deepspeed_all.world, 2, CASES, dict.fromkeys(STAGES, LOOPS), trainer, STEPS,
                              timeout_s=300.0, collective_timeout_s=60.0, env={"DS_ACCELERATOR": "cpu"},
                              preload=["torch._dynamo"])
    return {"raw": [r["raw"] for r in results], "shm_op_built": [r["shm_op_built"] for r in results],
            "accelerate": {s: [r["accelerate"][s] for r in results] for s in STAGES},
            "steps": [r["steps"] for r in results],
            "trainer": {s: [dict(zip(TRAINER_STAGES[s], r["trainer"][s], strict=True)) for r in results]
                        for s in STAGES}}


def test_deepspeed_compiled_nothing(world: dict[str, Any]) -> None:
    """DeepSpeed's CPU accelerator would JIT-compile its shared-memory op at init (minutes on 2 cores, for an op
    that only tensor-parallel inference uses): deepspeed_zero.no_shared_memory_op must keep working."""
    assert world["shm_op_built"] == [False, False], "DeepSpeed compiled deepspeed_shm_comm: see no_shared_memory_op"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("clip", [0.0, CLIP])
def test_every_step_applies_the_global_token_mean(world: dict[str, Any], stage: int, clip: float) -> None:
    """Uneven counts (a rank with none, the short last window), a parameter absent on one rank: exact on both
    ranks, one optimizer step per window, D = the window's tokens; clipped as DeepSpeed clips the exact gradient."""
    for r in world["raw"]:
        case = r[f"exact/{stage}/{clip}"]
        assert max(case["errors"]) < TOLERANCE, case["errors"]
        assert case["global_steps"] == 3 and case["divisors"] == [16.0, 10.0, 7.0], case
        if clip:
            assert min(case["true_norms"]) < clip < max(case["true_norms"]), case["true_norms"]


@pytest.mark.parametrize("stage", STAGES)
def test_the_ledger_is_the_accumulators(world: dict[str, Any], stage: int) -> None:
    """DeepSpeed's windows are counted by the accumulator's own window (the DeepSpeed wrapper behind the seam):
    weighted, M over both ranks, and participation counted by its hooks, at most M per parameter, every parameter
    that a microbatch reached counted at least once."""
    for r in world["raw"]:
        for window in r[f"exact/{stage}/0.0"]["counted"]:
            seen = window["participation"].values()
            assert window["weighting"] == "weighted" and window["m"] > 0, window
            assert seen and max(seen) <= window["m"] and max(seen) > 0, window


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeeds_own_recipe_is_not_the_token_mean(world: dict[str, Any], stage: int) -> None:
    """engine.backward(mean loss), gradient_accumulation_steps 3, even counts: the mean of microbatch means
    divided by 3 (the short window of 2 too). The README's table reads these errors."""
    errors = world["raw"][0][f"native/{stage}/0.0"]["errors"]
    print(f"DeepSpeed's own recipe, ZeRO-{stage}: relative errors per window {[round(e, 3) for e in errors]}")
    assert min(errors) > 0.4, errors


@pytest.mark.parametrize("stage", STAGES)
def test_random_plans_are_exact(world: dict[str, Any], stage: int) -> None:
    """Seeded random windows (0-3 microbatches per rank, 0-6 tokens each), unclipped (a clip that acts would
    hide a wrong scale); rerun one with GRADAGG_FUZZ_SEED=<seed>."""
    print(f"seed {SEED + stage}: plan {dz.random_plan(SEED + stage)}")
    for r in world["raw"]:
        case = r[f"fuzz/{stage}/0.0"]
        assert max(case["errors"]) < TOLERANCE, (SEED + stage, case["errors"])
        assert case["global_steps"] == 4, case


def test_unsupported_engines_are_refused_at_exact(world: dict[str, Any]) -> None:
    """ZeRO stage 0: a GradaggError naming the stage."""
    for r in world["raw"]:
        assert r["stage0"][0] == "GradaggError" and "ZeRO stage 0" in r["stage0"][1], r["stage0"]


def test_deepspeed_configs_as_users_write_them_are_exact(world: dict[str, Any]) -> None:
    """A seeded sample of gradient_accumulation_steps k 1..4 (given, or derived from train_batch_size) x ZeRO 1/2/3
    x uneven microbatch counts per rank (a rank with none, a short last window, more than k), DeepSpeed's reduction
    averaging or summing over the ranks (gradient_allreduce_op "sum", ZeRO-1/2): every window is exact
    against the float64 truth, its divisor is its count (tokens, or microbatches unweighted), never k, and DeepSpeed
    steps the optimizer and its scheduler once per window. Rerun one sample with GRADAGG_FUZZ_SEED=<seed>."""
    cases, reached = STEPS[0], collections.Counter(c for case in STEPS[0] for c in ds.classes(case))
    print(f"seed {SEED}: classes reached {dict(sorted(reached.items()))}")
    wanted = {f"k={k}" for k in range(1, 5)} | {f"zero-{s}" for s in STAGES} | {
        "derived k", "explicit k", "weighted", "unweighted", "a rank with no microbatch", "a window short of k",
        "config scheduler", "torch scheduler", "ZeRO-3 padded to one microbatch each, k > 1",
        "gradient_allreduce_op mean", "gradient_allreduce_op sum"}
    assert wanted <= set(reached), wanted - set(reached)
    for r in world["steps"]:
        for case, got in zip(cases, r["cases"], strict=True):
            windows = len(case["plan"])
            counts = [sum(v for c in w for v in c) if case["weighted"] else sum(len(c) for c in w)
                      for w in case["plan"]]
            assert "raised" not in got and max(got["errors"]) < TOLERANCE, (SEED, case, got)
            assert got["k"] == case["k"] and got["divisors"] == counts, (SEED, case, got)
            assert got["global_steps"] == windows and got["scheduler_steps"] == windows, (SEED, case, got)


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeeds_own_loop_is_refused_on_every_rank(world: dict[str, Any], stage: int) -> None:
    """engine.step() after every microbatch (DeepSpeed's recipe, k = 3) under exact: both ranks raise a WindowError at
    the first engine.step(), naming why, and neither the optimizer nor the scheduler steps. Then windows of one
    microbatch per rank: declared with set_gradient_accumulation_boundary(True), taken; the next, undeclared, refused
    again (a declaration holds for its window); after a window of 3 + 1 (not DeepSpeed's loop), taken."""
    fragment = "engine.step() after one microbatch on every rank, with gradient_accumulation_steps 3"
    for r in world["steps"]:
        case = r["recipe"][stage]
        assert "raised" not in case, case
        assert case["refused"].startswith("WindowError: rank ") and fragment in case["refused"], case
        assert len(case["later_refusals"]) == 1 and fragment in case["later_refusals"][0], case
        assert case["steps_after_refusal"] == [0, 0] and case["steps"] == [3, 3], case
        assert len(case["errors"]) == 3 and max(case["errors"]) < TOLERANCE, case


def test_a_share_float32_cannot_divide_by_is_refused_on_every_rank(world: dict[str, Any]) -> None:
    """A total weight D = 2e-38 over 2 ranks: DeepSpeed averages, so each rank's sum is divided by D / 2, below
    float32's smallest normal: both ranks raise a WindowError naming it, no step; the next window is exact."""
    for r in world["steps"]:
        case = r["tiny_share"]
        assert "raised" not in case, case
        assert case["refused"].startswith("WindowError: ") and "D / world = 1e-38" in case["refused"], case
        assert case["steps_after_refusal"] == [0, 0] and case["error_after"] < TOLERANCE, case


def test_auto_in_a_raw_config_is_refused_by_deepspeed(world: dict[str, Any]) -> None:
    """"auto" is the Hugging Face integration's to fill (TrainingArguments): deepspeed.initialize on a raw config
    with "gradient_accumulation_steps": "auto" raises (DeepSpeed 0.19.8: a TypeError comparing it with 0), so exact()
    never meets it. Should DeepSpeed start resolving it, this fails and exact() must be checked against it."""
    for r in world["steps"]:
        assert r["auto"] is not None and r["auto"].startswith("TypeError"), r["auto"]


def test_a_bad_weight_on_one_rank_raises_on_every_rank(world: dict[str, Any]) -> None:
    """weight=NaN on rank 0 only: both ranks raise WindowError naming rank 0, no step is taken, and the next
    window is exact."""
    for r in world["raw"]:
        kind, message = r["nan_weight"]
        assert kind == "WindowError" and "rank 0 had an invalid" in message, message
        assert r["steps_after_refusal"] == 0 and r["after_refusal_error"] < TOLERANCE, r
        assert r["closed"]
    assert "nan" in world["raw"][0]["nan_weight"][1]  # the rank that gave the weight names it


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("outside", "rank 1 poisoned (a backward ran outside microbatch()"),
        ("raised", "rank 1 poisoned (a microbatch raised"),
        ("mixed", "ranks counted their microbatches differently (rank 0 weighted; rank 1 unweighted)"),
        ("zero", "the total weight of the window is 0"),
        ("empty", "no microbatch run on any rank (M = 0)"),
    ],
)
def test_a_refused_window_raises_on_every_rank(world: dict[str, Any], case: str, fragment: str) -> None:
    """A window that cannot be counted, on one rank or all: both ranks raise WindowError and no step is taken."""
    for r in world["raw"]:
        kind, message = r[case]
        assert kind == "WindowError" and fragment in message, message
        assert r["steps_after_poison"] == 0


@pytest.mark.parametrize("stage", STAGES)
def test_accelerate_with_its_deepspeed_plugin_is_exact(world: dict[str, Any], stage: int) -> None:
    """A DeepSpeedAccumulator on the engine Accelerate prepared (gradient_accumulation_steps 3 in both):
    accelerator.backward(loss_sum) inside acc.microbatch(weight=tokens) is exact, the short last window included
    (Accelerate calls engine.step() inside the sync microbatch's backward); Accelerate's own recipe is not."""
    results = world["accelerate"][stage]
    for r in results:
        native = r["native"]
        for exact in (r["exact"], r["line"]):
            assert exact["stage"] == stage and exact["kind"].endswith("DEEPSPEED"), exact
            assert exact["windows"] == [3, 3, 3, 1] and exact["global_steps"] == 4, exact
            assert max(exact["errors"]) < TOLERANCE, exact["errors"]
        assert min(native["errors"]) > 0.4, native["errors"]
    print(f"ZeRO-{stage} under Accelerate, relative errors per window: Accelerate's own recipe "
          f"{[round(e, 3) for e in results[0]['native']['errors']]}, gradagg {results[0]['line']['errors']}")


@pytest.mark.parametrize("stage", STAGES)
def test_accelerates_exact_routes_deepspeed(world: dict[str, Any], stage: int) -> None:
    """integrations.accelerate.exact(accelerator, engine, optimizer) is the DeepSpeedAccumulator on the engine; a
    model that is not the engine, and DDP's options, are refused naming what was given."""
    for r in world["accelerate"][stage]:
        assert r["line"]["type"] == "DeepSpeedAccumulator", r["line"]
        not_engine, options = r["line"]["refused"]
        assert not_engine.startswith("GradaggError") and "model is a Tiny, not the DeepSpeedEngine" in not_engine
        assert options.startswith("GradaggError") and "options ['bucket_mb']" in options, options


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_with_deepspeed_steps_on_the_global_token_mean(world: dict[str, Any], stage: int) -> None:
    """exact(trainer) under ZeRO-1/2/3: every window's applied gradient is the token mean of both ranks' sequences
    (the short last window too), clipped by DeepSpeed as torch clips; the logged loss and grad_norm are the window's
    token mean and the exact gradient's norm; the Trainer's own with average_tokens_across_devices=False is not."""
    exact, native = world["trainer"][stage][0]["exact"], world["trainer"][stage][0]["avg_tokens"]
    assert exact["engine"] == "DeepSpeedEngine" and exact["stage"] == stage, exact
    assert exact["steps"] == 2 and exact["engine_steps"] == 2, exact
    windows = exact["windows"]
    assert [w["sequences"] for w in windows] == [12, 8], windows
    errors = [w["error"] for w in windows]
    print(f"ZeRO-{stage} under the Trainer, relative errors per window: gradagg {errors}, the Trainer's own with "
          f"average_tokens_across_devices=False {[round(w['error'], 3) for w in native['windows']]}")
    assert max(errors) < TOLERANCE, errors
    assert min(w["norm"] for w in windows) < CLIP < max(w["norm"] for w in windows), windows  # some clipped
    for log, w in zip(exact["logs"], windows, strict=True):
        assert math.isclose(log["loss"], w["loss"], rel_tol=TOLERANCE), (log, w)
        assert math.isclose(log["grad_norm"], w["norm"], rel_tol=TOLERANCE), (log, w)
    assert min(w["error"] for w in native["windows"]) > 0.05, native["windows"]


def test_the_trainers_defaults_under_deepspeed_are_already_exact(world: dict[str, Any]) -> None:
    """The Trainer's own defaults (average_tokens_across_devices=True, a model taking num_items_in_batch) under
    ZeRO-2: already the token mean, as the docs say (what gradagg adds there is the refusal of a bad count)."""
    default = world["trainer"][2][0]["defaults"]
    print(f"ZeRO-2 under the Trainer, its defaults: relative errors {[w['error'] for w in default['windows']]}")
    assert [w["sequences"] for w in default["windows"]] == [12, 8], default
    assert max(w["error"] for w in default["windows"]) < TOLERANCE, default["windows"]


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_fills_auto_with_its_gradient_accumulation_steps(world: dict[str, Any], stage: int) -> None:
    """"auto" filled by TrainingArguments.gradient_accumulation_steps k (1, 2 or 4, seeded over the stages) under
    exact(trainer): one step per window of k microbatches (the epoch's 5 leave a short last one), each exact."""
    k = AUTO_K[stage]
    auto = world["trainer"][stage][0]["auto"]
    sizes = [4 * k] * (5 // k) + ([4 * (5 % k)] if 5 % k else [])  # 2 sequences per microbatch, 2 ranks
    print(f"ZeRO-{stage}, auto = {k}: relative errors {[w['error'] for w in auto['windows']]}")
    assert auto["steps"] == len(sizes) and auto["engine_steps"] == len(sizes), auto
    assert [w["sequences"] for w in auto["windows"]] == sizes, auto
    assert max(w["error"] for w in auto["windows"]) < TOLERANCE, auto["windows"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_bad_count_stops_the_trainer_on_every_rank(world: dict[str, Any], stage: int) -> None:
    """A NaN count on rank 0 only: DeepSpeed's engine.step() of the first window raises on both ranks a WindowError
    naming rank 0 and the step, and no optimizer step is taken."""
    for r in world["trainer"][stage]:
        bad = r["bad"]
        assert bad["refused"].startswith("WindowError: step 0: exact() could not finish"), bad
        assert "rank 0 had an invalid" in bad["refused"], bad
        assert bad["steps"] == 0 and bad["engine_steps"] == 0, bad
