"""exact(trainer) under HF Trainer's FSDP1 on 2 gloo ranks, against the float64 one-process full batch of each step.

``TrainingArguments(fsdp="full_shard", fsdp_config={"version": 1, ...})``: Accelerate's FSDP plugin with
``fsdp_version=1``, its transformer auto-wrap policy (the root and one unit per decoder layer), built by the Trainer's
own ``accelerator.prepare`` as on a GPU. What is patched to get there on a CPU, and why (see
:mod:`tests.integrations.workers.hf_fsdp1`): ``sync_module_states=False`` (Accelerate's plugin and FSDP1's broadcast
both need an accelerator; every rank builds the same seeded model), and a Trainer subclass whose
``create_accelerator_and_postprocess`` sets Accelerate's state as on an accelerator (``DistributedType.FSDP``, the
plugin, the device ``cpu``) and ``is_fsdp_enabled``, where a CPU machine makes Accelerate drop the plugin for DDP;
and, for a strategy other than FULL_SHARD, ``FSDP_SHARDING_STRATEGY`` in the environment, as ``accelerate launch``
sets it (Accelerate 1.15's FSDP1 plugin ignores the Trainer's ``fsdp="shard_grad_op"``: it runs FULL_SHARD).

Data and windows as :mod:`tests.integrations.test_transformers`: one epoch of 5 microbatches of 2 sequences per
rank, ``gradient_accumulation_steps=3`` (a window of 3, then the short last window of 2), token counts that differ per
rank and step, ``max_grad_norm`` below both steps' true norms (FSDP1's own ``clip_grad_norm_`` on every step). Beside
each exact case the Trainer's own gradient in the same configuration.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import hf, hf_fsdp1  # noqa: E402

# float32 round-off, as the DDP and FSDP2 cases: each element a sum over a few hundred tokens' float32 terms, reduced
# in float32 over 2 ranks, divided once; the flat parameters' read-back adds one float32 rounding of each weight
TOLERANCE = 1e-5
OFF = 0.05  # the Trainer's own weighting without its defaults: at least this far off
CLIP = 0.2  # below both steps' true norms (asserted): every step clipped

CASES: dict[str, hf.Case] = {
    "exact/orig": {"exact": True, "clip": CLIP},  # use_orig_params=True, the Trainer's default
    "exact/flat": {"exact": True, "clip": CLIP, "orig": False},  # FSDP1's flat parameters
    "exact/avg_off": {"exact": True, "clip": CLIP, "avg_tokens": False},  # where the Trainer alone is off
    # even_batches=False, 9 microbatches dealt out: rank 0 runs 5, rank 1 4 (its last window of 1 beside rank 0's of 2)
    "exact/uneven_microbatches": {"exact": True, "clip": CLIP, "even_batches": False, "rows": 18},
    "exact/shard_grad_op": {"exact": True, "clip": CLIP, "strategy": "SHARD_GRAD_OP"},
    "native/orig": {"clip": CLIP},  # the Trainer's defaults: the global token mean on its own
    "native/avg_off": {"clip": CLIP, "avg_tokens": False},  # the mean of per-rank token means
    # FSDP1's NO_SHARD all-reduces the whole accumulated .grad at every backward: refused at the first step
    "refused/no_shard": {"exact": True, "strategy": "NO_SHARD"},
}


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    results = run_local_world(hf_fsdp1.cases_world, 2, list(CASES.values()), **hf.WORLD)[0]
    return dict(zip(CASES, results))


def test_the_trainer_built_fsdp1(world: dict[str, Any]) -> None:
    """The Trainer's own prepare wrapped the model in FSDP1: the root and one unit per decoder layer; every epoch a
    window of 3 microbatches (12 sequences over both ranks), then the short last window of 2 (8; 6 with 9 dealt)."""
    for name, case in CASES.items():
        if name.startswith("refused/"):
            continue
        got = world[name]
        assert "refused" not in got, (name, got)
        built = (got["wrapped"], got["units"], got["strategy"])
        assert built == ("FullyShardedDataParallel", 3, case.get("strategy", "FULL_SHARD")), (name, built)
        want = [12, 6] if case.get("even_batches") is False else [12, 8]
        assert [s["sequences"] for s in got["steps"]] == want, name


@pytest.mark.parametrize("config", ["orig", "flat", "avg_off", "uneven_microbatches", "shard_grad_op"])
def test_every_step_is_the_full_batch_mean_clipped(world: dict[str, Any], config: str) -> None:
    """exact(trainer) under FSDP1: each step's gradient, after FSDP1's own clip, is the float64 full batch's clipped
    token mean; the clip acted on every step; the logged loss and grad_norm are the window's true ones."""
    got = world[f"exact/{config}"]
    errors = [s["error"] for s in got["steps"]]
    assert max(errors) < TOLERANCE, errors
    assert min(s["norm"] for s in got["steps"]) > 1.5 * CLIP, got["steps"]
    assert len(got["logs"]) == len(got["steps"]) == 2
    for log, step in zip(got["logs"], got["steps"]):
        assert math.isclose(log["loss"], step["loss"], rel_tol=1e-5), (log, step)
        assert math.isclose(log["grad_norm"], step["norm"], rel_tol=1e-5), (log, step)


def test_the_trainers_own_fsdp1(world: dict[str, Any]) -> None:
    """The Trainer alone on the same FSDP1 model: its defaults give the global token mean already (within the same
    round-off); average_tokens_across_devices=False gives the mean of per-rank token means, off."""
    right = [s["error"] for s in world["native/orig"]["steps"]]
    wrong = [s["error"] for s in world["native/avg_off"]["steps"]]
    assert max(right) < TOLERANCE, right
    assert max(wrong) > OFF, wrong


def test_no_shard_is_refused_on_every_rank_naming_what_works(world: dict[str, Any]) -> None:
    """fsdp="no_shard": FSDP1 would all-reduce the whole accumulated gradient again at every backward; both ranks
    refuse at the first step, naming DDP and the sharded strategies."""
    refused = world["refused/no_shard"]["refused"]
    assert len(refused) == 2, refused
    for r in refused:
        assert r.startswith("GradaggError: ") and "uses NO_SHARD" in r and "FULL_SHARD / SHARD_GRAD_OP" in r, r
