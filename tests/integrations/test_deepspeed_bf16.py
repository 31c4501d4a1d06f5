"""gradagg.integrations.deepspeed with DeepSpeed bf16 (ZeRO 1, 2 and 3) on 2 and 3 gloo ranks, against float64.

One world per size runs every case (:mod:`tests.integrations.workers.deepspeed_bf16`): uneven microbatch counts
per rank (a rank with none, the short last window; ZeRO-3 padded with weight-0 microbatches), clipped and not; a
non-finite microbatch on one rank; and, on 2 ranks, gradagg beside DeepSpeed's own recipe in the same
configuration (even counts with uneven tokens; one window of 32 microbatches per rank, each the same full
sequence, where DeepSpeed's weighting is the token mean and only its bf16 accumulation differs), the bf16
engines exact() refuses, Accelerate's DeepSpeed plugin in bf16, and the Hugging Face Trainer with ``bf16=True`` and
``deepspeed=`` beside the Trainer's own recipe.

What "exact" means in bf16, and the bounds used here. The parameters are bf16, so each microbatch's forward and
backward round in bf16: that cost is the same for every recipe and is measured, not bounded, as ``floor`` (each
microbatch's bf16 gradient, computed again in one process, summed exactly in float64, against the float64 truth).
What the accumulation adds is bounded per element, from the dtypes (see ``units``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -r requirements-dev.txt)")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -r requirements-dev.txt)")
pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -r requirements-dev.txt)")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import deepspeed_bf16 as bf  # noqa: E402

STAGES = (1, 2, 3)
# per world, between the windows' true gradient norms (asserted): some steps clipped, some not (a gradient scaled
# wrongly would hide behind a clip that always acts)
CLIP = {2: 0.6, 3: 0.57}


def exact_cases(world: int) -> list[tuple[str, int, float]]:
    return [("exact", s, c) for s in STAGES for c in (0.0, CLIP[world])] + [("overflow", s, 0.0) for s in STAGES]


BESIDE = [(loop, s, 0.0) for s in STAGES for loop in ("even", "native", "many", "many_native")]
# the Hugging Face Trainer with bf16=True and deepspeed= (tests.integrations.workers.deepspeed_hf), clipped between
# its two windows' true norms (0.455 and 0.696, asserted): exact(trainer), its own defaults, and (under ZeRO-2: its
# weighting is the same at every stage) its own with average_tokens_across_devices=False
TRAINER_CLIP = 0.6
TRAINER = {"exact": {"exact": True, "clip": TRAINER_CLIP}, "defaults": {"clip": TRAINER_CLIP},
           "avg_tokens": {"avg_tokens": False, "clip": TRAINER_CLIP}}
TRAINER_STAGES = {s: [n for n in TRAINER if n != "avg_tokens" or s == 2] for s in STAGES}
# The Trainer's bf16 Llama, against the float64 truth of the same forward (at its bf16 parameters), max |g - t| /
# max |t|: the floor (each microbatch's bf16 forward and backward, a few u(bf16) = 2**-8 deep in a two-layer model,
# measured 0.005-0.009) plus what the accumulation adds (see units_bound), as the Trainer's autocast bf16 bound.
TRAINER_BOUND = 2e-2


def units_bound(world: int) -> float:
    """The accumulation's error per element, in units of bf16's round-off (2**-8) times the element's scale (the
    sum of |each microbatch's bf16 gradient| / D), against those gradients summed exactly.

    gradagg adds a rank's microbatches in float32 (their errors, 2**-24 each, are below one unit) and divides by
    the share in float32; then each element is rounded to bf16 once (1 unit), and DeepSpeed averages the ranks in
    bf16 (world - 1 additions and one division: world units). Clipping scales by a coefficient computed from that
    rounded gradient, whose norm can be off by as much again (world + 1). So 2 (world + 1): 6 units on 2 ranks, 8
    on 3, where a bf16 sum of k microbatches, DeepSpeed's own, may be off by k + world.
    """
    return 2.0 * (world + 1)


@pytest.fixture(scope="module")
def worlds() -> dict[int, list[dict[str, Any]]]:
    options: dict[str, Any] = {"timeout_s": 300.0, "collective_timeout_s": 60.0, "env": {"DS_ACCELERATOR": "cpu"},
                               "preload": ["torch._dynamo"]}
    trainer = {s: [TRAINER[n] for n in names] for s, names in TRAINER_STAGES.items()}
    return {2: run_local_world(bf.bf16_world, 2, exact_cases(2) + BESIDE, STAGES, trainer, **options),
            3: run_local_world(bf.bf16_world, 3, exact_cases(3), **options)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("clipped", [False, True])
def test_bf16_windows_are_the_token_mean_within_bf16_round_off(worlds: dict[int, list[dict[str, Any]]], world: int,
                                                                stage: int, clipped: bool) -> None:
    """Uneven counts (3+1, 0+2, the short 1+1 on 2 ranks; 3+1+0, 0+2+1, 1+1+1 on 3), a parameter absent on the
    other ranks: D = the window's tokens, one step per window, and each element within :func:`units_bound` of the
    exactly summed bf16 microbatch gradients (and so, normwise, within the floor plus that of the float64 truth).
    Clipped as DeepSpeed clips."""
    clip = CLIP[world] if clipped else 0.0
    for r in worlds[world]:
        case = r[f"exact/{stage}/{clip}"]
        assert case["divisors"] == ([16.0, 10.0, 7.0] if world == 2 else [16.0, 12.0, 10.0]), case["divisors"]
        assert case["applied"] == [True] * 3 and case["skipped_steps"] == 0, case
        for e in case["errors"]:
            assert e["units"] <= units_bound(world), (world, e)
        if clip:
            assert min(case["norms"]) < clip < max(case["norms"]), case["norms"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_a_non_finite_microbatch_on_one_rank_skips_the_step_on_every_rank(
        worlds: dict[int, list[dict[str, Any]]], world: int, stage: int) -> None:
    """Rank 0's second microbatch of window 1 back-propagates inf: DeepSpeed's bf16 overflow check (all-reduced)
    skips that step on every rank, no parameter moves, every rank's ledger says so; the windows before and after
    are exact."""
    for r in worlds[world]:
        case = r[f"overflow/{stage}/0.0"]
        assert case["applied"] == [True, False, True] and case["skipped_steps"] == 1, case
        assert case["errors"][1]["unchanged"], case["errors"][1]
        assert "DeepSpeed's step: skipped on every rank" in case["reports"][1], case["reports"][1]
        for e in (case["errors"][0], case["errors"][2]):
            assert not e["unchanged"] and e["units"] <= units_bound(world), e


@pytest.mark.parametrize("stage", STAGES)
def test_closer_than_deepspeeds_own_bf16_recipe(worlds: dict[int, list[dict[str, Any]]], stage: int) -> None:
    """The same engines, windows and data. Even counts with uneven tokens: DeepSpeed's mean of microbatch means is
    off by far more than bf16 (its weighting). One window of 32 microbatches per rank, each the same full sequence,
    where that weighting is the token mean: DeepSpeed sums their gradients, which point one way, in bf16, rounding
    at each addition, beyond :func:`units_bound`; gradagg sums in float32, within it, and is closer to the float64
    truth."""
    for r in (worlds[2][0],):
        mine, theirs = r[f"even/{stage}/0.0"]["errors"], r[f"native/{stage}/0.0"]["errors"]
        many, many_theirs = r[f"many/{stage}/0.0"]["errors"][0], r[f"many_native/{stage}/0.0"]["errors"][0]
        print(f"ZeRO-{stage} bf16, relative errors against float64: even counts gradagg "
              f"{[round(e['relative'], 4) for e in mine]}, DeepSpeed {[round(e['relative'], 4) for e in theirs]}; "
              f"32 per rank: gradagg {many['relative']:.4f} (added {many['added']:.4f}), DeepSpeed "
              f"{many_theirs['relative']:.4f} (added {many_theirs['added']:.4f}), floor {many['floor']:.4f}")
        for a, b in zip(mine, theirs, strict=True):
            assert a["units"] <= units_bound(2) and a["relative"] < b["relative"], (a, b)
        assert many["relative"] < many_theirs["relative"] and many["added"] < many_theirs["added"], (many, many_theirs)
        assert many["units"] <= units_bound(2) < many_theirs["units"], (many, many_theirs)


@pytest.mark.parametrize("stage", STAGES)
def test_accelerates_deepspeed_plugin_in_bf16(worlds: dict[int, list[dict[str, Any]]], stage: int) -> None:
    """``Accelerator(mixed_precision="bf16")`` with a DeepSpeed plugin, gradagg.integrations.accelerate.exact: the
    engine is bf16, steps once per window (3, 3, 3 and the short 1 per rank), and each window is within
    :func:`units_bound`, the window's last microbatch included (Accelerate steps inside its backward)."""
    for r in worlds[2]:
        case = r[f"accelerate/{stage}"]
        assert case["dtype"] == "torch.bfloat16" and case["global_steps"] == 4, case
        assert max(e["units"] for e in case["errors"]) <= units_bound(2), case["errors"]


@pytest.mark.parametrize("stage", STAGES)
def test_the_trainer_with_deepspeed_bf16_is_the_token_mean_within_bf16_round_off(
        worlds: dict[int, list[dict[str, Any]]], stage: int) -> None:
    """TrainingArguments(bf16=True, deepspeed=ZeRO config with "bf16": "auto") under exact(trainer): a bf16 engine,
    one step per window (3 microbatches of uneven tokens per rank, then the short 2), each window within
    TRAINER_BOUND of the float64 truth at the bf16 parameters, and what the accumulation added against each
    microbatch's bf16 gradient summed exactly within :func:`units_bound` units of u(bf16) of the largest entry;
    the logged loss and grad_norm are the window's. The Trainer's own in the same configuration: with
    average_tokens_across_devices=False off by its weighting (ZeRO-2); with its defaults (the token mean's weighting,
    DeepSpeed's bf16 sum of the window) adding more than gradagg on the first window (both start from the same
    parameters)."""
    runs = dict(zip(TRAINER_STAGES[stage], worlds[2][0][f"trainer/{stage}"], strict=True))
    ours, own = runs["exact"], runs["defaults"]
    print(f"ZeRO-{stage} bf16 under the Trainer, max relative errors per window: gradagg {_rounded(ours, 'error')} "
          f"(added {_rounded(ours, 'added')}, floor {_rounded(ours, 'floor')}); the Trainer's own defaults "
          f"{_rounded(own, 'error')} (added {_rounded(own, 'added')}), average_tokens_across_devices=False "
          f"{_rounded(runs.get('avg_tokens', {'windows': []}), 'error')}")
    for run in runs.values():
        assert run["dtype"] == "torch.bfloat16" and run["stage"] == stage, run
        assert run["steps"] == 2 and run["engine_steps"] == 2, run
        assert [w["sequences"] for w in run["windows"]] == [12, 8], run["windows"]
    windows = ours["windows"]
    assert min(w["norm"] for w in windows) < TRAINER_CLIP < max(w["norm"] for w in windows), windows  # one clipped
    for w in windows:
        assert w["error"] < TRAINER_BOUND and w["added"] <= units_bound(2) * bf.BF16_U, w
        assert w["floor"] > 1e-3, w  # bf16's round-off is there: the forward ran in bf16 (float32's stays < 1e-5)
    for log, w in zip(ours["logs"], windows, strict=True):
        # the loss: a float32 sum of bf16 forwards' token losses (measured 2e-6 off); the norm: DeepSpeed's, of the
        # bf16 gradient it clipped (measured 2e-4 off)
        assert math.isclose(log["loss"], w["loss"], rel_tol=1e-3), (log, w)
        assert math.isclose(log["grad_norm"], w["norm"], rel_tol=TRAINER_BOUND), (log, w)
    if "avg_tokens" in runs:
        assert min(w["error"] for w in runs["avg_tokens"]["windows"]) > 0.05, runs["avg_tokens"]["windows"]
    assert windows[0]["added"] < own["windows"][0]["added"], (windows[0], own["windows"][0])


def _rounded(run: dict[str, Any], key: str) -> list[float]:
    return [round(w[key], 4) for w in run["windows"]]


@pytest.mark.parametrize(("name", "fragment"), [
    ("grad_accum_fp32", "bf16 with data_types.grad_accum_dtype float32 is not supported; leave grad_accum_dtype"),
    ("no_overflow_check", "bf16 with bf16.check_grad_overflow false (or unreadable) would step on a non-finite"),
])
def test_bf16_engines_exact_cannot_make_exact_are_refused_at_exact(worlds: dict[int, list[dict[str, Any]]],
                                                                   name: str, fragment: str) -> None:
    """ZeRO-1 with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, which cannot keep a window's
    gradients local; without the overflow check DeepSpeed would apply a non-finite step: one line each, naming what
    works."""
    for r in worlds[2]:
        kind, message = r["refused"][name]
        assert kind == "GradaggError" and fragment in message and "\n" not in message, message
