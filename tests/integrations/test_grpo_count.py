"""What gradagg undoes of TRL's GRPO divisors, and the weight it counts instead, in one process (issue 36).

``grpo_count`` against TRL 1.16's divisors as its module's table states them, counted here by a plain Python walk
over the completion mask (a fully masked completion, a tool mask, an empty microbatch); ``check_grpo``'s refusals.
The trainer is a stand-in holding the public fields ``grpo_count`` reads; the real GRPOTrainer runs in
test_grpo.py (gloo ranks).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gradagg.errors import GradaggError
from gradagg.integrations._grpo import MODES, TESTED, check_grpo, grpo_count

GA, MAX_LEN, RANKS, PER_GENERATION, GENERATION_TOKENS = 3, 8, 2, 4, 40.0
MASK = [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]  # 3 completions, the second fully masked
TOOL = [[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]  # multi-turn tool use: token 1 of completion 0 is a tool's


def trainer(loss_type: str, **fields: Any) -> Any:
    kept = {"loss_type": loss_type, "current_gradient_accumulation_steps": GA, "max_completion_length": MAX_LEN,
            "accelerator": SimpleNamespace(num_processes=RANKS),
            "args": SimpleNamespace(steps_per_generation=PER_GENERATION)}
    return SimpleNamespace(**{**kept, **fields})


def truth(loss_type: str, mask: list[list[int]]) -> tuple[float, float]:
    """TRL 1.16's divisor of one microbatch (the module's table) and the mode's weight, by a Python walk."""
    rows = len(mask)
    tokens = sum(sum(row) for row in mask)
    sequences = sum(1 for row in mask if any(row))  # a fully masked completion counts in no divisor
    if loss_type == "grpo":
        return rows * GA, sequences
    if loss_type == "bnpo":
        return max(tokens, 1) * GA, tokens
    if loss_type == "dr_grpo":
        return rows * MAX_LEN * GA, sequences * MAX_LEN
    return max(GENERATION_TOKENS, 1.0) / RANKS * GA / PER_GENERATION, tokens  # dapo, cispo


@pytest.mark.parametrize("loss_type", sorted(MODES))
@pytest.mark.parametrize("case", ["mask", "tool mask", "nothing valid"])
def test_grpo_count_is_trls_divisor_and_the_modes_weight(loss_type: str, case: str) -> None:
    mask = [[0] * 4] * 2 if case == "nothing valid" else MASK
    inputs: dict[str, Any] = {"completion_mask": torch.tensor(mask),
                              "num_items_in_batch": torch.tensor(GENERATION_TOKENS)}
    if case == "tool mask":
        inputs["tool_mask"] = torch.tensor(TOOL)
        mask = [[m * t for m, t in zip(mr, tr)] for mr, tr in zip(mask, TOOL)]
    divisor, weight = grpo_count(trainer(loss_type), inputs)
    assert (float(divisor), float(weight)) == truth(loss_type, mask), (loss_type, case, divisor, weight)


def test_grpo_count_refuses_what_it_cannot_count() -> None:
    with pytest.raises(GradaggError, match=r"2-dim 'completion_mask' tensor \(keys: \['labels'\]\)"):
        grpo_count(trainer("grpo"), {"labels": torch.ones(2, 3)})
    with pytest.raises(GradaggError, match="2-dim 'completion_mask'"):
        grpo_count(trainer("grpo"), {"completion_mask": torch.ones(3)})
    with pytest.raises(GradaggError, match="loss_type 'dapo' must hold TRL's 'num_items_in_batch'"):
        grpo_count(trainer("dapo"), {"completion_mask": torch.ones(2, 3)})


def test_check_grpo_accepts_the_tested_configurations() -> None:
    for loss_type in MODES:
        assert check_grpo(trainer(loss_type, args=SimpleNamespace(entropy_coef=0.0)), "1.16.0") is None


@pytest.mark.parametrize(("version", "loss_type", "fields", "reasons"), [
    ("1.15.2", "grpo", {}, ["TRL 1.15.2 (exact() knows GRPO's divisors of TRL 1.16.x)"]),
    ("1.16.0", "sapo", {}, ["loss_type 'sapo' (supported: grpo, bnpo, dr_grpo, dapo, cispo)"]),
    ("1.16.0", "grpo", {"args": SimpleNamespace(entropy_coef=0.1)}, ["an entropy bonus"]),
    ("1.16.0", "grpo", {"args": SimpleNamespace(use_adaptive_entropy=True)}, ["an entropy bonus"]),
    ("1.16.0", "grpo", {"aux_loss_enabled": True}, ["a MoE router auxiliary loss"]),
    ("2.0.0", None, {"aux_loss_enabled": True}, ["TRL 2.0.0", "loss_type None", "a MoE router auxiliary loss"]),
])
def test_check_grpo_refuses_what_exact_cannot_make_exact(
    version: str, loss_type: str | None, fields: dict[str, Any], reasons: list[str]
) -> None:
    """Every reason named, in one message, "; "-separated, after the trainer's class name."""
    stand_in = SimpleNamespace(loss_type=loss_type, **fields)
    with pytest.raises(GradaggError) as info:
        check_grpo(stand_in, version)
    message = str(info.value)
    assert message.startswith("exact() cannot make this SimpleNamespace exact: "), message
    parts = message.split(": ", 1)[1].split("; ")
    assert len(parts) == len(reasons) and all(p.startswith(r) for p, r in zip(parts, reasons)), (parts, reasons)


def test_a_generation_batch_counting_nothing_divides_by_one_token() -> None:
    """dapo, cispo: TRL clamps the generation batch's global tokens at 1 (a batch of fully masked completions)."""
    inputs = {"completion_mask": torch.zeros(2, 3), "num_items_in_batch": torch.tensor(0.0)}
    divisor, weight = grpo_count(trainer("dapo"), inputs)
    assert (float(divisor), float(weight)) == (1.0 / RANKS * GA / PER_GENERATION, 0.0)


def test_a_microbatch_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(GradaggError, match=r"'completion_mask' tensor \(keys: list\)"):
        grpo_count(trainer("grpo"), [torch.ones(2, 3)])


def test_check_grpo_reads_the_installed_version_and_a_trainer_without_a_loss_type() -> None:
    """Without version=, the installed TRL's is read (one of TESTED here: a dapo trainer passes); an object with no
    loss_type is refused as such, not with an AttributeError."""
    import trl

    class Bare:
        loss_type = "dapo"

    assert str(trl.__version__).startswith(TESTED)
    check_grpo(Bare())
    with pytest.raises(GradaggError, match=r"cannot make this object exact: loss_type None \(supported: "):
        check_grpo(object(), version="1.16.3")
