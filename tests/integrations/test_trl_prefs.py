"""exact() on TRL's DPOTrainer (exact, pairs counted) and on what it refuses, 2 gloo ranks.

DPO: the tiny Llama against a frozen copy of itself, 5 microbatches per rank of 1, 2, 3, 1, 2 preference pairs (a
collator drops the rest: uneven pairs per microbatch and per step; the same on both ranks at the same microbatch,
as TRL's own per-microbatch gather of per-pair rewards needs), windows of 3 then 2; every step's gradient against the
float64 one-process mean over the step's pairs of DPO's sigmoid loss, TRL's own gradient beside it. Refused at
exact(), on every rank, before training: RLOO, DPO with a loss that is not a per-pair mean (GRPO, exact since
issue 23: tests/integrations/test_grpo.py). Refused at ``on_train_begin``, on every rank, with
a short timeout so a regression fails instead of hanging: SFT and DPO on ranks running 6 and 5 microbatches
(Accelerate's ``even_batches=False``), where TRL's per-microbatch metric gathers would meet gradagg's ``finish()``.
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
from tests.integrations.workers import hf, prefs  # noqa: E402

# float32 round-off: a pair's log-probabilities are float32 sums over up to 20 tokens, reduced in float32 over
# 2 ranks; TRL's reference log-probabilities are float32 too (the truth's are float64), which moves each pair's
# sigmoid argument by ~1e-6 relative. Observed errors stay near 1e-6; TRL's own gradient is off by more than 5%.
TOLERANCE = 1e-4
LOG_TOLERANCE = 1e-4
OFF = 0.05
# a regression of the uneven-ranks refusal hangs in TRL's metric gather: the world fails at this deadline instead
WORLD = {**hf.WORLD, "collective_timeout_s": 15.0, "timeout_s": 420.0}

CASES: dict[str, prefs.Case] = {
    "dpo/exact": {"trainer": "dpo", "exact": True},
    "dpo/native": {"trainer": "dpo"},
    "refused/rloo": {"trainer": "rloo", "exact": True},
    "refused/dpo_sft_loss": {"trainer": "dpo", "exact": True, "loss_type": ["sigmoid", "sft"]},
    "uneven/sft": {"trainer": "sft", "exact": True, "uneven": True},
    "uneven/dpo": {"trainer": "dpo", "exact": True, "uneven": True},
}


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    results = run_local_world(prefs.cases_world, 2, list(CASES.values()), **WORLD)[0]
    return dict(zip(CASES, results))


def test_dpo_pairs_are_uneven_per_step(world: dict[str, Any]) -> None:
    """The collator keeps 1 + 2 + 3 pairs per rank in the first window, 1 + 2 in the short last one."""
    pairs = [s["pairs"] for s in world["dpo/exact"]["steps"]]
    assert pairs == [12, 6], pairs
    assert pairs == [s["pairs"] for s in world["dpo/native"]["steps"]]


def test_dpo_every_step_is_the_mean_over_all_pairs(world: dict[str, Any]) -> None:
    """exact(dpo_trainer): each step's gradient is the float64 mean over the step's pairs (both ranks, every
    microbatch) of the per-pair loss; TRL's own (a mean of microbatch means) is off. Both printed."""
    ours = [s["error"] for s in world["dpo/exact"]["steps"]]
    trl = [s["error"] for s in world["dpo/native"]["steps"]]
    print(f"DPO relative gradient error per step: gradagg exact() {ours}, TRL's own {trl}")
    assert max(ours) < TOLERANCE, ours
    assert max(trl) > OFF, trl


def test_dpo_logged_loss_is_the_mean_over_pairs(world: dict[str, Any]) -> None:
    got = world["dpo/exact"]
    assert len(got["logs"]) == len(got["steps"]) == 2
    for log, step in zip(got["logs"], got["steps"], strict=True):
        assert math.isclose(log["loss"], step["loss"], rel_tol=LOG_TOLERANCE), (log, step)


@pytest.mark.parametrize(("case", "trainer", "algo"), [("refused/rloo", "RLOOTrainer", "RLOO")])
def test_rl_trainers_are_refused_at_exact_on_every_rank(world: dict[str, Any], case: str, trainer: str,
                                                        algo: str) -> None:
    refused = world[case]["refused"]
    assert len(refused) == 2, refused
    for r in refused:
        assert r.startswith(f"GradaggError: exact() cannot make this {trainer} exact: {algo} is not yet supported"), r
        assert "keys:" not in r, r


def test_dpo_loss_that_is_no_per_pair_mean_is_refused(world: dict[str, Any]) -> None:
    refused = world["refused/dpo_sft_loss"]["refused"]
    assert len(refused) == 2 and all("loss_type ['sft'] is not a mean of a per-pair loss" in r for r in refused), \
        refused


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_uneven_microbatches_per_rank_are_refused_before_training(world: dict[str, Any], trainer: str) -> None:
    """even_batches=False, 6 microbatches on rank 0 and 5 on rank 1: refused on both ranks at on_train_begin
    (before the fix: a deadlock, one rank in TRL's gather_for_metrics and the other in finish())."""
    refused = world[f"uneven/{trainer}"]["refused"]
    assert len(refused) == 2, refused
    for r in refused:
        assert r.startswith("GradaggError: exact() cannot train this"), r
        assert "different numbers of microbatches per epoch (rank 0: 6, rank 1: 5)" in r, r


def test_every_trl_trainer_class_is_supported_or_refused_by_name() -> None:
    """The class: every Trainer subclass TRL defines (its main and experimental modules that import here) is
    SFT, DPO or GRPO, or refused at exact() naming it; a user's subclass of SFTTrainer is an SFTTrainer."""
    import importlib
    import pkgutil

    import trl
    from transformers import Trainer

    from gradagg.integrations._trl import check_trl

    classes: set[type] = set()
    for info in pkgutil.walk_packages(trl.__path__, "trl."):
        if not info.name.startswith(("trl.trainer.", "trl.experimental.")):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception as exc:  # an optional dependency missing here: that module's trainers are not checked
            print(f"skipped {info.name}: {type(exc).__name__}")
            continue
        classes |= {c for c in vars(module).values()
                    if isinstance(c, type) and issubclass(c, Trainer) and c.__module__.startswith("trl.")}
    supported = {"trl.trainer.sft_trainer.SFTTrainer": "sft", "trl.trainer.dpo_trainer.DPOTrainer": "dpo",
                 "trl.trainer.grpo_trainer.GRPOTrainer": "grpo"}
    assert set(supported) <= {f"{c.__module__}.{c.__qualname__}" for c in classes}, classes
    assert len(classes) >= 10, sorted(c.__name__ for c in classes)
    for cls in classes:
        bare = object.__new__(cls)
        bare.loss_types = ["sigmoid"]  # what DPOTrainer.__init__ would set from DPOConfig's default
        bare.loss_type = "dapo"  # what GRPOTrainer.__init__ would set from GRPOConfig's default
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in supported:
            assert check_trl(bare) == supported[name], name
            continue
        with pytest.raises(GradaggError, match=f"exact\\(\\) cannot make this {cls.__name__} exact: .* is not yet "
                                               f"supported \\({name}"):
            check_trl(bare)


def test_a_users_subclass_is_what_it_subclasses() -> None:
    from trl import GRPOTrainer, SFTTrainer

    from gradagg.integrations._trl import check_trl

    assert check_trl(object.__new__(type("MySFT", (SFTTrainer,), {}))) == "sft"
    assert check_trl(object.__new__(type("MyGRPO", (GRPOTrainer,), {"loss_type": "grpo"}))) == "grpo"
    with pytest.raises(GradaggError, match="cannot make this MyGRPO exact: loss_type 'luspo'"):
        check_trl(object.__new__(type("MyGRPO", (GRPOTrainer,), {"loss_type": "luspo"})))
