"""gradagg.integrations.transformers.exact on 2 gloo ranks, against the float64 one-process full batch of each step.

One world runs every case (transformers imports slowly): the tiny Llama trained by a Hugging Face ``Trainer`` for
one epoch of 5 microbatches of 2 right-padded sequences per rank, ``gradient_accumulation_steps=3``: a window of 3
microbatches, then the epoch's short last window of 2; token counts that differ per rank and step. DDP as the
Trainer builds it on CPU, and transformers' own FSDP2 (``from_pretrained(distributed_config=DistributedConfig(
fsdp_size=2))``). Next to each exact case, the Trainer's own gradient in the same configuration.
"""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from gradagg.errors import GradaggError  # noqa: E402
from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import hf  # noqa: E402

# float32 round-off: each gradient element is a sum over a few hundred tokens' float32 terms, reduced in float32
# over 2 ranks, then divided once; observed relative errors stay below 1e-6, and every wrong divisor here is off
# by more than 10%.
TOLERANCE = 1e-5
# The logged loss and grad_norm are float32 sums of the same terms (the loss over ~250 tokens, the norm over every
# parameter's squares): well inside 1e-5 relative.
LOG_TOLERANCE = 1e-5
OFF = 0.05  # the Trainer's own wrong gradients: at least this far off (measured 0.13 and more)
CLIP = 0.2  # below both steps' true gradient norms (asserted): every step clipped, the clip changes the gradient

CASES: dict[str, hf.Case] = {
    "exact/defaults": {"exact": True},
    "native/defaults": {},
    "exact/avg_off": {"exact": True, "avg_tokens": False},
    "native/avg_off": {"avg_tokens": False},
    "exact/no_kwargs": {"exact": True, "loss_kwargs": False},
    "native/no_kwargs": {"loss_kwargs": False},
    "exact/clip": {"exact": True, "clip": CLIP},
    "native/clip": {"clip": CLIP},
    "exact/clip_no_kwargs": {"exact": True, "clip": CLIP, "loss_kwargs": False},
    "exact/two_optimizers": {"exact": True, "clip": CLIP, "two": True},  # one container over two, as Trainer holds
    "native/clip_no_kwargs": {"clip": CLIP, "loss_kwargs": False},
    "exact/tagging": {"exact": True, "loss": "tagging", "weight": True},
    "native/tagging": {"loss": "tagging"},
    # a compute_loss_func that divides by num_items_in_batch: exact() passes it the microbatch's count (before: None,
    # a TypeError; or, written "/ (num_items_in_batch or 1)", the sum, the gradient x the window's count)
    "exact/tagging_div": {"exact": True, "loss": "tagging_div", "weight": True},
    "exact/tagging_or1": {"exact": True, "loss": "tagging_or1", "weight": True},
    "exact/causal_func": {"exact": True, "loss": "causal", "weight": True},
    "exact/fsdp": {"exact": True, "fsdp": True},
    "native/fsdp": {"fsdp": True},
    "exact/fsdp_avg_off": {"exact": True, "fsdp": True, "avg_tokens": False},
    "native/fsdp_avg_off": {"fsdp": True, "avg_tokens": False},
    "exact/fsdp_clip": {"exact": True, "fsdp": True, "clip": CLIP},
    # even_batches=False, 9 microbatches dealt out: rank 0 runs 5, rank 1 4, both in 2 steps (rank 1's last window
    # of 1 beside rank 0's of 2): exact, not refused
    "exact/uneven_microbatches": {"exact": True, "even_batches": False, "rows": 18},
    # refusals last: a failed window leaves nothing behind, but the cases above need not rely on it
    "refused/tagging_without_weight": {"exact": True, "loss": "tagging"},
    # even_batches=False, 7 microbatches: rank 0 runs 4 (2 steps), rank 1 3 (1 step)
    "refused/uneven_steps": {"exact": True, "even_batches": False, "rows": 14},
}
# A count that cannot count, on one rank only: two chosen (a full window, the short last one), then a seeded
# draw of rank, microbatch and value
SEED = 1414
BAD = [{"rank": 1, "at": 2, "value": "nan"}, {"rank": 0, "at": 5, "value": "negative"},
       *({"rank": r.randrange(2), "at": r.randint(1, hf.MICROBATCHES), "value": r.choice(sorted(hf.BAD_VALUES))}
         for r in [random.Random(SEED)] for _ in range(2))]
CASES.update({f"refused/bad{i}": {"exact": True, "bad": bad} for i, bad in enumerate(BAD)})
EXACT = [k.split("/", 1)[1] for k in CASES if k.startswith("exact/")]
RIGHT_ON_ITS_OWN = ["defaults", "clip", "fsdp"]  # the Trainer's defaults: the global token mean already
WRONG_ON_ITS_OWN = ["avg_off", "no_kwargs", "clip_no_kwargs", "tagging", "fsdp_avg_off"]


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    results = run_local_world(hf.cases_world, 2, list(CASES.values()), **hf.WORLD)[0]
    return dict(zip(CASES, results))


def test_what_the_trainer_built(world: dict[str, Any]) -> None:
    """DDP over 2 CPU processes, or transformers' FSDP2 (DTensor parameters); every epoch a window of 3
    microbatches (12 sequences over both ranks), then the short last window of 2 (8)."""
    for name, case in CASES.items():
        if name.startswith("refused/"):
            continue
        got = world[name]
        if case.get("fsdp"):
            assert (got["wrapped"], got["param_type"]) == ("FSDPLlamaForCausalLM", "DTensor"), name
        else:
            assert got["wrapped"] == "DistributedDataParallel", name
        want = [12, 6] if case.get("even_batches") is False else [12, 8]  # uneven: windows of 3 + 3, then 2 + 1
        assert [s["sequences"] for s in got["steps"]] == want, name


@pytest.mark.parametrize("config", EXACT)
def test_every_step_is_the_full_batch_mean(world: dict[str, Any], config: str) -> None:
    """exact(trainer): each step's gradient (clipped where max_grad_norm is set) is the float64 full batch's."""
    errors = [s["error"] for s in world[f"exact/{config}"]["steps"]]
    assert max(errors) < TOLERANCE, errors


@pytest.mark.parametrize("config", RIGHT_ON_ITS_OWN)
def test_the_trainers_defaults_are_right_on_their_own(world: dict[str, Any], config: str) -> None:
    errors = [s["error"] for s in world[f"native/{config}"]["steps"]]
    assert max(errors) < TOLERANCE, errors


@pytest.mark.parametrize("config", WRONG_ON_ITS_OWN)
def test_the_trainer_is_wrong_on_its_own(world: dict[str, Any], config: str) -> None:
    """average_tokens_across_devices=False: the mean of per-rank token means; a model without loss kwargs, or a
    compute_loss_func returning a mean: the mean of microbatch means. The short last window is off in each."""
    errors = [s["error"] for s in world[f"native/{config}"]["steps"]]
    assert max(errors) > OFF, errors


@pytest.mark.parametrize("config", ["clip", "clip_no_kwargs", "fsdp_clip"])
def test_every_step_clipped(world: dict[str, Any], config: str) -> None:
    """The clip is active on every step: the true norms are above max_grad_norm, so the unclipped truth differs
    from the clipped one by far more than the tolerance."""
    norms = [s["norm"] for s in world[f"exact/{config}"]["steps"]]
    assert min(norms) > 1.5 * CLIP, norms


@pytest.mark.parametrize("config", EXACT)
def test_logged_loss_and_grad_norm_are_exact(world: dict[str, Any], config: str) -> None:
    """logging_steps=1: the logged loss is the window's true token mean, the logged grad_norm the exact norm
    before the clip."""
    got = world[f"exact/{config}"]
    assert len(got["logs"]) == len(got["steps"]) == 2
    for log, step in zip(got["logs"], got["steps"]):
        assert math.isclose(log["loss"], step["loss"], rel_tol=LOG_TOLERANCE), (log, step)
        assert math.isclose(log["grad_norm"], step["norm"], rel_tol=LOG_TOLERANCE), (log, step)


def test_the_trainers_own_log_is_off_without_its_defaults(world: dict[str, Any]) -> None:
    """What exact() fixes in the log too: the Trainer's loss with a model without loss kwargs is a mean of
    microbatch means, its grad_norm that of its wrong gradient."""
    got = world["native/no_kwargs"]
    loss_off = max(abs(log["loss"] - s["loss"]) / s["loss"] for log, s in zip(got["logs"], got["steps"]))
    norm_off = max(abs(log["grad_norm"] - s["norm"]) / s["norm"] for log, s in zip(got["logs"], got["steps"]))
    assert max(loss_off, norm_off) > 1e-3, (loss_off, norm_off)


def test_applied_twice_or_after_train_is_refused(world: dict[str, Any]) -> None:
    """A second exact() after train(): 'already applied' where it was applied, 'before train()' where not."""
    assert world["exact/defaults"]["again"].startswith("GradaggError: exact() was already applied"), world
    for name in ("native/defaults", "native/fsdp"):
        assert world[name]["again"].startswith("GradaggError: exact() must be called before train()"), world[name]


def test_compute_loss_func_without_weight_is_refused(world: dict[str, Any]) -> None:
    refused = world["refused/tagging_without_weight"]["refused"]
    assert len(refused) == 2 and all("cannot count the tokens of a compute_loss_func" in r for r in refused), refused


@pytest.mark.parametrize("i", range(len(BAD)))
def test_a_count_that_cannot_count_is_refused_on_every_rank(world: dict[str, Any], i: int) -> None:
    """A negative, NaN, infinite or too large count on one rank only: both ranks raise (no rank left waiting in
    the window's reduction), naming the step and the rank; that rank names the microbatch and its value."""
    bad = BAD[i]
    step, microbatch = divmod(bad["at"] - 1, hf.WINDOW)  # windows of 3 microbatches, then the last one of 2
    value = {"nan": "nan", "negative": "-3.0", "inf": "inf", "beyond_float64": "inf"}[bad["value"]]
    refused = world[f"refused/bad{i}"]["refused"]
    where = f"seed {SEED}, case {bad}"
    assert len(refused) == 2, (where, refused)
    for r in refused:
        assert r.startswith(f"WindowError: step {step}: exact() could not finish"), (where, r)
        assert f"rank {bad['rank']} had an invalid or inconsistent microbatch weight" in r, (where, r)
        assert "discard()" not in r, (where, r)  # exact() dropped the window itself
    mine = refused[bad["rank"]]
    assert f"microbatch {microbatch} has weight {value}: a weight must be finite and non-negative" in mine, where


def test_ranks_with_different_steps_per_epoch_are_refused_on_every_rank(world: dict[str, Any]) -> None:
    """even_batches=False with 7 microbatches of 2 sequences: rank 0 would run 2 optimizer steps, rank 1 one (its
    finish() would pair with rank 0's next window): refused on both ranks at the start of train(), naming both
    counts. Ranks with different microbatches in as many steps train exactly (exact/uneven_microbatches)."""
    refused = world["refused/uneven_steps"]["refused"]
    assert len(refused) == 2, refused
    for r in refused:
        assert r.startswith("GradaggError: exact() cannot train this Trainer on ranks with different numbers of "
                            "optimizer steps per epoch"), r
        assert "rank 0: 2 step(s) of 4 microbatch(es), rank 1: 1 step(s) of 3 microbatch(es)" in r, r


def test_uneven_steps_against_the_trainers_loop() -> None:
    """Seeded (seed 3031): 300 draws of 2-4 ranks' loader lengths (0-9, or unknown), a window of 1-4 and even_batches:
    refused exactly where the Trainer's epoch loop, walked in plain Python (a step at every window-th microbatch and
    at the epoch's last; one step for an empty epoch), gives the ranks different step counts, or where a length is
    unknown with even_batches=False or beside known ones. Every class was drawn, and the check catches the wrong
    rule (refusing different microbatch counts)."""
    from gradagg.integrations.transformers import uneven_steps

    def loop_steps(n: int, window: int) -> int:
        return max(sum(1 for k in range(1, n + 1) if k % window == 0 or k == n), 1)

    seed = 3031
    rng, drawn = random.Random(seed), dict.fromkeys(["same", "microbatches differ", "steps differ", "unknown"], 0)
    for draw in range(300):
        ranks, window, even = rng.randint(2, 4), rng.randint(1, 4), rng.random() < 0.5
        lengths = [None if rng.random() < 0.1 else rng.randint(0, 9) for _ in range(ranks)]
        known = [n for n in lengths if n is not None]
        steps = {loop_steps(n, window) for n in known}
        cls = ("unknown" if None in lengths else "steps differ" if len(steps) > 1
               else "microbatches differ" if len(set(known)) > 1 else "same")
        drawn[cls] += 1
        want = len(steps) > 1 or (None in lengths and (not even or bool(known)))
        got = uneven_steps(lengths, window, even)
        assert (got is not None) == want, (seed, draw, lengths, window, even, got)
        if cls == "microbatches differ":
            assert len(set(known)) > 1 and got is None  # the wrong rule would refuse these
    assert all(drawn.values()), drawn


def test_not_a_trainer_is_refused() -> None:
    from gradagg.integrations.transformers import exact

    with pytest.raises(GradaggError, match="exact\\(\\) takes a transformers.Trainer, got dict"):
        exact({"model": None})


@pytest.mark.parametrize("value", [True, "12", [3]])
def test_a_count_that_is_not_a_number_is_refused(value: object) -> None:
    from gradagg.integrations.transformers import _count

    with pytest.raises(GradaggError, match="step 4: the microbatch's count must be a non-negative number"):
        _count(value, 4)


def test_bench_hf_quick_runs() -> None:
    """bench/bench_hf.py --quick (not a timed test): both forms train end to end and the table names the ratio
    (the figures are bench/RESULTS.md's, from a full run)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run([sys.executable, "bench/bench_hf.py", "--quick"], capture_output=True, text=True,
                          cwd=root, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"^\| Trainer step, plain \| [\d.]+ ms \| [\d.]+ ms \| 1 \(baseline\) \|", done.stdout, re.M)
    ratios = r"( \d\.\d{3} \|){3} <= 1.05 \|$"
    assert re.search(r"^\| Trainer step, exact\(trainer\) \| [\d.]+ ms \| [\d.]+ ms \|" + ratios, done.stdout, re.M), \
        done.stdout


BF16_CASES: dict[str, hf.Case] = {
    "exact/bf16": {"exact": True, "bf16": True, "clip": CLIP},
    "native/bf16_avg_off": {"bf16": True, "avg_tokens": False},
}
# bf16 autocast rounds the forward's and backward's matmuls to 8 significant bits (2**-8 ~ 4e-3 per rounding); the
# window's sums stay float32: within BF16_TOLERANCE of the float64 truth without autocast.
BF16_TOLERANCE = 2e-2


def test_the_trainers_bf16_switch_is_exact_within_the_round_off() -> None:
    """TrainingArguments(bf16=True) with exact(trainer), clipped: every step the float64 full-batch mean within bf16's
    round-off; the Trainer's own recipe with average_tokens_across_devices=False stays off by its weighting."""
    results = dict(zip(BF16_CASES, run_local_world(hf.cases_world, 2, list(BF16_CASES.values()), **hf.WORLD)[0]))
    ours = [s["error"] for s in results["exact/bf16"]["steps"]]
    native = [s["error"] for s in results["native/bf16_avg_off"]["steps"]]
    assert len(ours) == 2 and max(ours) < BF16_TOLERANCE, ours
    assert min(ours) > 1e-5, ours  # bf16's round-off is there: the switch acted (float32 stays below 1e-6)
    assert max(native) > OFF, native
