"""gradagg.integrations.transformers.exact on TRL's SFTTrainer, 2 gloo ranks, against the float64 full batch.

The same world as tests/integrations/test_transformers.py (the tiny Llama, 5 microbatches of 2 right-padded
sequences per rank, windows of 3 then the short last window of 2, DDP), trained by ``SFTTrainer`` from a
``datasets.Dataset`` of pre-tokenised rows with prompt labels -100 and a tokenizer built in the test. SFTTrainer
keeps its own ``compute_loss`` (entropy and token accuracy metrics) and collator; exact() wraps them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import hf  # noqa: E402

# float32 round-off: each gradient element is a sum over a few hundred tokens' float32 terms, reduced in float32
# over 2 ranks, then divided once; observed relative errors stay below 1e-6, every wrong divisor is off by >10%.
TOLERANCE = 1e-5
LOG_TOLERANCE = 1e-5  # the logged loss and norm: float32 sums of the same terms
OFF = 0.05  # SFTTrainer's own wrong gradients: at least this far off (measured 0.13 and more)
CLIP = 0.2  # below both steps' true gradient norms (asserted)

CASES: dict[str, hf.Case] = {
    "exact/defaults": {"trainer": "sft", "exact": True},
    "native/defaults": {"trainer": "sft"},
    "exact/avg_off": {"trainer": "sft", "exact": True, "avg_tokens": False},
    "native/avg_off": {"trainer": "sft", "avg_tokens": False},
    "exact/clip": {"trainer": "sft", "exact": True, "clip": CLIP},
    # SFTTrainer calls a compute_loss_func itself: given the microbatch's count as num_items_in_batch
    "exact/causal_func": {"trainer": "sft", "exact": True, "loss": "causal", "weight": True},
    "exact/tagging_div": {"trainer": "sft", "exact": True, "loss": "tagging_div", "weight": True},
}


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    results = run_local_world(hf.cases_world, 2, list(CASES.values()), **hf.WORLD)[0]
    return dict(zip(CASES, results))


def test_sft_trainer_runs_ddp_with_a_short_last_window(world: dict[str, Any]) -> None:
    for name in CASES:
        assert world[name]["wrapped"] == "DistributedDataParallel", name
        assert [s["sequences"] for s in world[name]["steps"]] == [12, 8], name


@pytest.mark.parametrize("config", ["defaults", "avg_off", "clip", "causal_func", "tagging_div"])
def test_every_step_is_the_full_batch_token_mean(world: dict[str, Any], config: str) -> None:
    got = world[f"exact/{config}"]
    errors = [s["error"] for s in got["steps"]]
    assert max(errors) < TOLERANCE, errors
    for log, step in zip(got["logs"], got["steps"], strict=True):  # logging_steps=1: the true mean, the exact norm
        assert math.isclose(log["loss"], step["loss"], rel_tol=LOG_TOLERANCE), (log, step)
        assert math.isclose(log["grad_norm"], step["norm"], rel_tol=LOG_TOLERANCE), (log, step)


def test_the_clip_is_active_on_every_step(world: dict[str, Any]) -> None:
    norms = [s["norm"] for s in world["exact/clip"]["steps"]]
    assert min(norms) > 1.5 * CLIP, norms


def test_sft_trainers_own_gradient(world: dict[str, Any]) -> None:
    """Right with the defaults (SFTTrainer passes the token count through), off with
    average_tokens_across_devices=False (the mean of the ranks' token means)."""
    assert max(s["error"] for s in world["native/defaults"]["steps"]) < TOLERANCE
    assert max(s["error"] for s in world["native/avg_off"]["steps"]) > OFF
    assert world["native/defaults"]["again"].startswith("GradaggError: exact() must be called before train()")
