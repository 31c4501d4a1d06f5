"""The frameworks' fp16 switches on a CPU machine (torch 2.13 CPU, Accelerate 1.15, transformers 5.24, Lightning
2.6): none of them computes in fp16 there, so none has an fp16 path for gradagg to make exact on CPU (docs/contracts.md,
"Low precision"). Accelerate's ``mixed_precision="fp16"`` builds a GradScaler and autocast only on a GPU, so on CPU
it, and the Hugging Face Trainer's ``fp16=True`` through it, run float32 (and ``exact(trainer)`` is exact as float32);
Lightning replaces ``"16-mixed"`` on CPU by ``"bf16-mixed"`` with a warning (tested under gradagg in
``test_lightning.py``). A framework version that starts running fp16 on CPU fails here: its fp16 path is then one to
test. One process (:mod:`tests.integrations.workers.fp16_cpu`), no process group."""

from __future__ import annotations

from typing import Any

import pytest

for _name in ("accelerate", "transformers", "lightning"):
    pytest.importorskip(_name, reason=f"{_name} is not installed (pip install -r requirements-dev.txt)")

from gradagg.testing import launch_process  # noqa: E402
from tests.integrations.workers import fp16_cpu  # noqa: E402

# float32 round-off: each gradient element sums a few hundred float32 token terms (the Trainer's float32 cases stay
# below 3e-6, test_transformers.py); an fp16 forward would be off by more than 1e-4 (u(fp16) = 2**-11 per rounding)
FLOAT32_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def switches() -> dict[str, Any]:
    outcome = launch_process(fp16_cpu.fp16_switches, timeout_s=180.0, preload=["torch._dynamo"])
    assert outcome.ok, outcome
    return outcome.value  # type: ignore[no-any-return]


def test_accelerates_fp16_on_cpu_has_no_scaler_and_no_autocast(switches: dict[str, Any]) -> None:
    """``Accelerator(cpu=True, mixed_precision="fp16")`` says fp16, builds no GradScaler, and its ``autocast()``
    leaves a Linear in float32."""
    assert switches["accelerate"] == {"mixed_precision": "fp16", "scaler": False, "dtype": "torch.float32"}


def test_the_trainers_fp16_on_cpu_runs_float32_and_exact_is_exact_there(switches: dict[str, Any]) -> None:
    """``TrainingArguments(fp16=True, use_cpu=True)``: accepted by ``exact(trainer)``, no scaler, the LM head
    computes in float32, and the window of 3 microbatches is the float64 token mean of its 6 sequences within
    float32's round-off."""
    trainer = switches["trainer"]
    assert trainer["scaler"] is False and trainer["dtypes"] == ["torch.float32"] and trainer["steps"] == 1, trainer
    assert trainer["error"] < FLOAT32_TOLERANCE, trainer


def test_lightnings_16_mixed_on_cpu_runs_bf16(switches: dict[str, Any]) -> None:
    """``precision="16-mixed"`` on CPU: Lightning runs ``"bf16-mixed"`` instead and warns that fp16 AMP is not
    supported on CPU."""
    lightning = switches["lightning"]
    assert lightning["precision"] == "bf16-mixed", lightning
    assert any("16-mixed" in w and "not supported on CPU" in w for w in lightning["warnings"]), lightning
