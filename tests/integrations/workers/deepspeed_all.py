"""Every DeepSpeed case of tests/integrations/test_deepspeed.py in one 2-rank world, part after part on each rank.

DeepSpeed, transformers, Accelerate and torch's inductor (which DeepSpeed's first engine imports) are imported
once per rank for all of them: a world per ZeRO stage or per framework paid those imports again each time. The
parts: raw engines (:mod:`deepspeed_zero`), Accelerate's DeepSpeed plugin (:mod:`deepspeed_accel`) and the
Hugging Face Trainer with ``deepspeed=`` (:mod:`deepspeed_hf`), configs as users write them
(:mod:`deepspeed_steps`), each of which resets Accelerate's state itself.
"""

from __future__ import annotations

from typing import Any

from tests.integrations.workers import deepspeed_accel, deepspeed_hf, deepspeed_steps
from tests.integrations.workers import deepspeed_zero as dz


def world(raw: list[tuple[str, int, float, int]], accelerate: dict[int, list[str]],
          trainer: dict[int, list[dict[str, Any]]], steps: tuple[list[dict[str, Any]], list[int]]) -> dict[str, Any]:
    """``raw`` as :func:`deepspeed_zero.deepspeed_world`; ``accelerate``: ZeRO stage -> loops of
    :func:`deepspeed_accel.accelerate_world`; ``trainer``: ZeRO stage -> cases of :func:`deepspeed_hf.stage_world`;
    ``steps``: the arguments of :func:`deepspeed_steps.steps_world`. Returns each part's results, and whether
    DeepSpeed compiled its shared-memory op (it must not)."""
    out: dict[str, Any] = {"raw": dz.deepspeed_world(raw), "shm_op_built": dz.shared_memory_op_built()}
    out["steps"] = deepspeed_steps.steps_world(*steps)
    out["accelerate"] = {stage: deepspeed_accel.accelerate_world(stage, loops) for stage, loops in accelerate.items()}
    out["trainer"] = {stage: deepspeed_hf.stage_world(stage, cases) for stage, cases in trainer.items()}
    return out
