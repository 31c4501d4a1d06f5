"""What exact() refuses under DeepSpeed, before any engine runs: ZeRO stage 0, fp16, bf16 without DeepSpeed's
overflow check or with fp32 gradient accumulation, for Accelerate's
DeepSpeed plugin (integrations.accelerate.exact) and the Trainer's ``deepspeed=`` (integrations.transformers).

Stand-ins for the engine and the Trainer's DeepSpeed config, so that this runs without DeepSpeed installed: the
exact cases, on real engines, are tests/integrations/test_deepspeed.py. In CI (``CI=true``) DeepSpeed must be
installed, so that those run rather than skip: asserted here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gradagg.errors import GradaggError
from gradagg.integrations import accelerate as integration


class _Engine:
    """The DeepSpeedEngine methods gradagg reads, for one stage and precision."""

    dp_world_size = 1

    def __init__(self, stage: int, dtype: str = "float32") -> None:
        self.stage, self.dtype = stage, dtype

    def coalesce_grad_reduction(self) -> None:
        raise AssertionError("a refused engine is never entered")

    def zero_optimization_stage(self) -> int:
        return self.stage

    def fp16_enabled(self) -> bool:
        return self.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.dtype == "bf16"

    def managed_gradient_accumulation(self) -> bool:
        return True

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.dtype, torch.float32)
        return dtype, getattr(self, "accum", dtype)


def _bf16(accum: torch.dtype = torch.bfloat16, checked: bool | None = True) -> _Engine:
    """A bf16 stand-in: its gradient accumulation dtype, and DeepSpeed's ``bf16.check_grad_overflow`` as DeepSpeed
    0.19.8 keeps it (None: an engine without that private config, whose check cannot be read)."""
    engine: Any = _Engine(2, "bf16")
    engine.accum = accum
    if checked is not None:
        engine._config = SimpleNamespace(bfloat16_config=SimpleNamespace(check_grad_overflow=checked))
    return engine


DEEPSPEED = SimpleNamespace(distributed_type="DistributedType.DEEPSPEED")


@pytest.mark.parametrize(
    ("engine", "fragment"),
    [(_Engine(0), "ZeRO stage 0 is not supported"),
     (_Engine(3, "fp16"), "fp16 is not supported (DeepSpeed's loss scaling under exact() is untested"),
     (_bf16(checked=None), "bf16 with bf16.check_grad_overflow false (or unreadable) would step"),
     (_bf16(checked=False), "bf16 with bf16.check_grad_overflow false (or unreadable) would step"),
     (_bf16(accum=torch.float32), "bf16 with data_types.grad_accum_dtype float32 is not supported"),
     (object(), "model is a object, not the DeepSpeedEngine")],
)
def test_accelerate_refuses_what_deepspeeds_accumulator_cannot_make_exact(engine: Any, fragment: str) -> None:
    with pytest.raises(GradaggError, match="under DeepSpeed") as caught:
        integration.exact(DEEPSPEED, engine, object())
    assert fragment in str(caught.value), caught.value


def test_an_engine_that_does_not_say_how_it_reduces_is_refused() -> None:
    """Each rank's share of D is D / world where DeepSpeed averages and D where it sums (gradient_allreduce_op): an
    engine without DeepSpeed 0.19.8's ``gradient_average`` flag cannot tell which, and is refused at exact()."""
    from gradagg.integrations.deepspeed import exact

    engine: Any = _Engine(1)
    with pytest.raises(GradaggError, match=r"exact\(engine\): .* averages or sums \(no bool gradient_average\)"):
        exact(engine)


def test_accelerate_still_refuses_megatron() -> None:
    with pytest.raises(GradaggError, match="MEGATRON_LM runs its own backward"):
        engine: Any = _Engine(1)
        integration.exact(SimpleNamespace(distributed_type="DistributedType.MEGATRON_LM"), engine, object())


class _Config:
    """The Trainer's DeepSpeed config as Accelerate's ``HfDeepSpeedConfig`` reads it: dotted keys to values."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def get_value(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def is_true(self, key: str) -> bool:
        return bool(self.values.get(key, False))

    def is_false(self, key: str) -> bool:
        return key in self.values and not self.values[key]


BF16 = {"bf16.enabled": True}


@pytest.mark.parametrize(
    ("stage", "values", "args", "fragments"),
    [(0, {}, {}, ["DeepSpeed ZeRO stage 0 (gradagg needs ZeRO stage 1, 2 or 3"]),
     (2, BF16, {}, []),
     (3, {}, {"bf16": True}, []),
     (1, {**BF16, "data_types.grad_accum_dtype": "fp32"}, {},
      ["DeepSpeed bf16 with data_types.grad_accum_dtype 'fp32' (leave it unset"]),
     (2, {**BF16, "data_types.grad_accum_dtype": "bf16"}, {}, []),
     (2, {**BF16, "bf16.check_grad_overflow": False}, {},
      ["DeepSpeed bf16 with bf16.check_grad_overflow false (leave it true"]),
     (3, {}, {"fp16": True}, ["DeepSpeed with fp16"]),
     (0, {"fp16.enabled": True}, {}, ["ZeRO stage 0", "DeepSpeed with fp16"]),
     (1, {}, {}, [])],
)
def test_the_trainer_refuses_what_deepspeeds_accumulator_cannot_make_exact(
        stage: int, values: dict[str, Any], args: dict[str, bool], fragments: list[str]) -> None:
    """Read from the Trainer's DeepSpeed config at exact(), before any engine exists: what exact(engine) would
    refuse at the first step (ZeRO stage 0, fp16, bf16 without DeepSpeed's bf16 ZeRO optimizer or its overflow
    check); float32 and bf16 as DeepSpeed defaults them pass."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from gradagg.integrations.transformers import _deepspeed_problems

    plugin = SimpleNamespace(zero_stage=stage, hf_ds_config=_Config(values))
    trainer = SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)),
                              args=SimpleNamespace(**{"fp16": False, "bf16": False, **args}))
    problems = _deepspeed_problems(trainer)
    assert len(problems) == len(fragments), problems
    for problem, fragment in zip(problems, fragments, strict=True):
        assert fragment in problem, problems


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="outside CI DeepSpeed is optional (its tests skip)")
def test_ci_has_what_the_deepspeed_tests_need() -> None:
    """In CI test_deepspeed.py must run, not skip: DeepSpeed at requirements-dev.txt's pin, transformers, Accelerate."""
    for name in ("deepspeed", "transformers", "accelerate"):
        assert importlib.util.find_spec(name) is not None, f"CI lacks {name}: install requirements-dev.txt"
    pins = (Path(__file__).resolve().parents[2] / "requirements-dev.txt").read_text().splitlines()
    pin = next(line.split("==")[1] for line in pins if line.startswith("deepspeed=="))
    assert importlib.metadata.version("deepspeed") == pin, (importlib.metadata.version("deepspeed"), pin)
