"""A wrapper the accumulator was not given (:mod:`gradagg.torch.accumulate.wrapped`): refused at the first forward
through it, on every rank, naming the wrapper and the fix. 2 gloo ranks, uneven counts; workers in
``tests.torch.workers.wrapped``. Before: DDP and FSDP1 aborted a rank inside gloo (``EnforceNotMet ... Received data
size doesn't match``, SIGABRT, no GradaggError) once the ranks ran different microbatch counts."""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import wrapped

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0}


@pytest.mark.parametrize("when", ["after", "inner"])
@pytest.mark.parametrize("kind", ["DDP", "FSDP1 orig", "FSDP1 flat"])
def test_a_wrapper_the_accumulator_was_not_given_is_refused_on_every_rank(kind: str, when: str) -> None:
    for said in run_local_world(wrapped.wrapped_world, 2, kind, when, **WORLD):
        # the module inside FSDP1 is told at construction (its parameters are flattened), the others at the forward
        start = "GradaggError: parameter " if kind.startswith("FSDP1") and when == "inner" else "GradaggError: rank "
        assert said.startswith(start) and f"({kind.split()[0]})" in said, said
        assert "give the accumulator the wrapped module" in said, said


@pytest.mark.parametrize("when", ["after", "inner"])
def test_a_deepspeed_engine_the_accumulator_was_not_given_is_refused_on_every_rank(when: str) -> None:
    """ZeRO-2 around the model (after the accumulator was built, or the accumulator given ``engine.module``): the
    fix named is gradagg.integrations.deepspeed.exact(engine)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -r requirements-dev.txt)")
    for said in run_local_world(wrapped.wrapped_world, 2, "DeepSpeed", when, **WORLD):
        assert said.startswith("GradaggError: rank ") and "(DeepSpeed)" in said and "exact(engine)" in said, said


def test_the_module_inside_fsdp1_is_refused_without_fsdp1s_private_mark_too() -> None:
    """The fallback where FSDP1's private ``_fsdp_flattened`` mark is missing: the ranks' pieces differ, and the
    layout check refuses them on every rank at construction."""
    for said in run_local_world(wrapped.wrapped_world, 2, "FSDP1 orig", "inner unmarked", **WORLD):
        assert said.startswith("CollectiveError: accumulated parameters differ"), said


def test_fully_shard_applied_after_the_accumulator_is_refused_on_every_rank() -> None:
    for said in run_local_world(wrapped.wrapped_world, 2, "FSDP2", "after", **WORLD):
        assert said.startswith("GradaggError: rank ") and "(FSDP2)" in said and "after fully_shard" in said, said
