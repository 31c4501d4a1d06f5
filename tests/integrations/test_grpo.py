"""exact(grpo_trainer) on TRL's GRPOTrainer, 2 gloo ranks: every step is the loss_type's mode over the step's window.

The tiny Llama generates offline (:mod:`tests.integrations.workers.grpo`): 2 completions per prompt, 1 to 6 tokens,
2 rows per microbatch; 2 optimizer steps per case. Every step's gradient against the float64 one-process truth over
exactly the step's completions (their advantages, TRL's old and reference log-probabilities taken from the run),
TRL's own gradient beside gradagg's, printed. The configurations make the window differ from the generation batch:
``steps_per_generation`` 4 with GA 2 (a generation spans two steps), 2 with GA 4 (a step spans two generations),
``num_iterations`` 2, ``beta`` 0.1 (the KL term, aggregated by the same mode), fully masked completions
(``mask_truncated_completions``: counted in no divisor here, in TRL's rows for grpo).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from gradagg.errors import GradaggError  # noqa: E402
from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import grpo, hf  # noqa: E402

# float32 round-off: each token's loss is a float32 log-softmax of a float32 forward, summed over at most 48 tokens,
# reduced in float32 over 2 ranks, TRL's divisor undone by one float32 multiplication; the truth reuses TRL's float32
# old and reference log-probabilities, so a clipped ratio sits within ~1e-7 of TRL's. Observed errors stay near 1e-6.
TOLERANCE = 1e-5
LOG_TOLERANCE = 1e-5

SWEEP_SEED = 23  # the seeded sweep's configurations: printed by test_a_seeded_sweep_of_configurations_is_exact
CONFIGS: dict[str, grpo.Case] = {
    "grpo": {"loss_type": "grpo", "spg": 4, "ga": 2, "beta": 0.1},
    "grpo_masked": {"loss_type": "grpo", "spg": 2, "ga": 2, "mask_truncated": True},
    "bnpo": {"loss_type": "bnpo", "spg": 2, "ga": 2, "iters": 2},
    "dr_grpo": {"loss_type": "dr_grpo", "spg": 4, "ga": 2, "beta": 0.1},
    "dapo": {"loss_type": "dapo", "spg": 4, "ga": 2},
    "cispo": {"loss_type": "cispo", "spg": 2, "ga": 4, "epsilon_high": 5.0},
}
CASES: dict[str, grpo.Case] = {
    **{f"exact/{name}": {**config, "exact": True} for name, config in CONFIGS.items()},
    **{f"native/{name}": config for name, config in CONFIGS.items()},
    **{f"sweep/{k}": config for k, config in enumerate(grpo.sweep(SWEEP_SEED, 4))},
    "refused/weight": {"loss_type": "dapo", "exact": True, "weight": True},
    "refused/sapo": {"loss_type": "sapo", "exact": True},
    "refused/entropy": {"loss_type": "dapo", "exact": True, "entropy_coef": 0.01},
}


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    results = run_local_world(grpo.cases_world, 2, list(CASES.values()), **{**hf.WORLD, "timeout_s": 600.0})[0]
    return dict(zip(CASES, results))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_step_is_the_loss_types_mode_over_the_window(world: dict[str, Any], name: str) -> None:
    """gradagg's gradient is the float64 mode over the step's completions on both ranks; TRL's own printed beside."""
    ours, trl = world[f"exact/{name}"], world[f"native/{name}"]
    assert "refused" not in ours, ours
    ours_err, trl_err = [s["error"] for s in ours["steps"]], [s["error"] for s in trl["steps"]]
    print(f"GRPO {name} {CONFIGS[name]}: relative gradient error per step: gradagg exact() {ours_err}, "
          f"TRL's own {trl_err}")
    assert len(ours_err) == grpo.STEPS, ours
    assert max(ours_err) < TOLERANCE, ours_err
    # the same completions: the first step's (a later generation samples from parameters TRL stepped otherwise)
    assert ours["steps"][0]["lengths"] == trl["steps"][0]["lengths"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logged_loss_is_the_modes_value(world: dict[str, Any], name: str) -> None:
    got = world[f"exact/{name}"]
    assert len(got["logs"]) == len(got["steps"]), got["logs"]
    for log, step in zip(got["logs"], got["steps"], strict=True):
        assert math.isclose(log["loss"], step["loss"], rel_tol=LOG_TOLERANCE, abs_tol=1e-7), (log, step)


def test_a_seeded_sweep_of_configurations_is_exact(world: dict[str, Any]) -> None:
    """The class: loss type, steps_per_generation, GA, num_iterations, beta, fully masked completions, drawn."""
    for name in (n for n in CASES if n.startswith("sweep/")):
        errors = [s["error"] for s in world[name]["steps"]]
        print(f"sweep seed {SWEEP_SEED}: {CASES[name]}: errors {errors}")
        assert len(errors) == grpo.STEPS and max(errors) < TOLERANCE, (SWEEP_SEED, CASES[name], world[name])


def test_completion_lengths_differ_per_step_and_rank(world: dict[str, Any]) -> None:
    """The completions are uneven (else every mode is the same and TRL's divisors are right by chance)."""
    for name in CONFIGS:
        steps = [s["lengths"] for s in world[f"exact/{name}"]["steps"]]
        assert all(len(set(lengths)) > 1 for lengths in steps), (name, steps)
        half = len(steps[0]) // 2  # rank 0's rows, then rank 1's
        assert any(sum(lengths[:half]) != sum(lengths[half:]) for lengths in steps), (name, steps)
    assert any(0 in s["lengths"] for s in world["exact/grpo_masked"]["steps"])


def test_trls_own_token_means_are_off(world: dict[str, Any]) -> None:
    """bnpo (a mean of microbatch token means) and dapo (the generation batch's count rescaled) are off TRL's own
    documented global token mean when lengths differ; grpo with fully masked completions counts them in its rows."""
    for name in ("bnpo", "dapo", "grpo_masked"):
        errors = [s["error"] for s in world[f"native/{name}"]["steps"]]
        assert max(errors) > 10 * TOLERANCE, (name, errors)


@pytest.mark.parametrize(("case", "text"), [
    ("refused/weight", "counts this GRPOTrainer's completions by its loss_type ('dapo'); it takes no weight="),
    ("refused/sapo", "loss_type 'sapo' (supported: grpo, bnpo, dr_grpo, dapo, cispo)"),
    ("refused/entropy", "an entropy bonus"),
])
def test_what_exact_cannot_make_exact_is_refused_on_every_rank(world: dict[str, Any], case: str, text: str) -> None:
    refused = world[case]["refused"]
    assert len(refused) == 2, refused
    for r in refused:
        assert r.startswith("GradaggError: exact() ") and text in r, r


def test_an_untested_trl_version_is_refused() -> None:
    """The divisors gradagg undoes are TRL 1.16's implementation: another version is refused, naming it."""
    from trl import GRPOTrainer

    from gradagg.integrations._grpo import check_grpo

    bare = object.__new__(GRPOTrainer)
    bare.loss_type = "dapo"
    check_grpo(bare, version="1.16.3")
    with pytest.raises(GradaggError, match=r"cannot make this GRPOTrainer exact: TRL 1\.17\.0 \(exact\(\) knows"):
        check_grpo(bare, version="1.17.0")
