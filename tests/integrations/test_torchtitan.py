"""torchtitan 0.3.0 on 2 gloo ranks: its own Llama 3 and ``parallelize_llama``, its own train_step, the example's.

The model is the issue's tiny Llama built by torchtitan itself and parallelized by its own code (FSDP2 per block and
at the root, selective activation checkpointing, FSDP's division off), with the CPU shims of
``tests.integrations.workers.titan_model``. Windows of 3 microbatches of 2 right-padded sequences (3 to 48 tokens,
prompts and padding -100), token counts different on every rank and window, the third window short (2 and 2; then
2 and 1, the data ending unevenly). Each step's applied gradient is compared with the float64 one-process token mean
over exactly the sequences the window consumed, at the parameters of that step, clipped as torch clips
(max_norm 0.1, below every window's norm, so every step clips).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchtitan")  # pinned in requirements-dev.txt: CI installs it

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import titan  # noqa: E402

# torchtitan imports torch._dynamo on first use in every rank; the fork server imports it once instead. Its model
# build and first backward take seconds on a loaded machine: a generous collective timeout.
WORLD: dict[str, Any] = {"collective_timeout_s": 60.0, "timeout_s": 300.0, "preload": ["torch._dynamo"]}
# float32 forward and backward (torchtitan's RoPE casts to float32 even in the float64 reference) against float64,
# sums of <= ~300 per-token terms in another order and FSDP's reduce-scatter: a few hundred float32 ulps (2**-24
# each) of the largest gradient at most; seen <= 6e-7. The mistakes it must catch are far larger: bf16 compute
# (torchtitan's default) 6e-3, a clip skipped 3.0.
TOL = 1e-5
# (backend, activation checkpointing, zero_grad(set_to_none=True), ChunkedLossWrapper): torchtitan's defaults are
# AC on, set_to_none=False (CUDA graphs on) and, in the llama3 configs, the chunked loss.
CONFIGS = [("partial_dtensor", False, True, False), ("full_dtensor", False, True, False),
           ("partial_dtensor", False, True, True), ("partial_dtensor", True, False, False),
           ("full_dtensor", True, False, True)]
KEYS = [", ".join(map(str, c)) for c in CONFIGS]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_local_world(titan.exact_world, 2, CONFIGS, **WORLD)


@pytest.fixture(scope="module")
def today() -> dict[str, dict[str, Any]]:
    return run_local_world(titan.today_world, 2, **WORLD)[0]  # type: ignore[no-any-return]


def _check_steps(steps: list[dict[str, float]], windows: int, logged_loss_scale: int = 1) -> None:
    assert len(steps) == windows
    for k, s in enumerate(steps):
        assert s["norm"] > titan.MAX_NORM, (k, s)  # the clip changed the gradient: the check sees a skipped one
        assert s["error"] <= TOL, (k, s)
        assert s["logged_norm"] == pytest.approx(s["norm"], rel=TOL), (k, s)  # grad_norm: the exact, unclipped norm
        assert s["logged_loss"] == pytest.approx(logged_loss_scale * s["loss"], rel=TOL), (k, s)  # the true token mean


def _exact(runs: list[dict[str, Any]], key: str, name: str) -> dict[str, Any]:
    result = runs[0][key][name]
    assert "raised" not in result, result.get("tb", result.get("raised"))
    return result  # type: ignore[no-any-return]


def test_torchtitan_own_train_step_is_exact(runs: list[dict[str, Any]]) -> None:
    """torchtitan's own train_step (prefetch, all-reduced count, clip) matches the truth: the issue reports it right.

    Its logged loss under full_dtensor is 2 x the mean on 2 ranks: ``loss.detach().clone()`` turns the Partial loss
    DTensor into a Replicate one (an all-reduce), which ``dist_sum`` then sums over the ranks again. A logging slip of
    torchtitan 0.3.0, not of the gradient; the example logs the true mean there too."""
    for (backend, *_), key in zip(CONFIGS, KEYS, strict=True):
        _check_steps(runs[0][key]["own"], 3, logged_loss_scale=2 if backend == "full_dtensor" else 1)


@pytest.mark.parametrize("key", KEYS)
def test_example_counts_as_the_window_runs_and_agrees_with_torchtitan(runs: list[dict[str, Any]], key: str) -> None:
    """examples/torchtitan_exact.py on the same data as torchtitan's own step: both at the truth, within TOL of each
    other; the short last window exact; training ends after it (DataloaderExhaustedError at step 3) on every rank."""
    exact = _exact(runs, key, "exact")
    _check_steps(exact["steps"], 3)
    assert all(e <= 2 * TOL for e in runs[0][key]["own vs exact"])
    assert [r[key]["exact"]["ended"] for r in runs] == [3, 3]


@pytest.mark.parametrize("key", KEYS)
def test_example_is_exact_when_the_data_ends_unevenly(runs: list[dict[str, Any]], key: str) -> None:
    """Rank 1's data ends one microbatch early (last window 2 and 1, which torchtitan's own step cannot run): exact,
    and both ranks end training after that window. Rank 1 pads the last round with its last microbatch through
    torchtitan's forward and loss (with ChunkedLossWrapper the default replay of the forward alone would miss
    lm_head, which that loss runs, and the ranks would hang)."""
    _check_steps(_exact(runs, key, "exact uneven")["steps"], 3)
    assert [r[key]["exact uneven"]["ended"] for r in runs] == [3, 3]


def _exact_case(today: dict[str, dict[str, Any]], case: str) -> None:
    result = today[case]
    assert "raised" not in result, result["raised"]
    assert result["error"] <= TOL, result


def test_accumulator_on_torchtitan_fsdp2_without_checkpointing(today: dict[str, dict[str, Any]]) -> None:
    """parallelize_llama without activation checkpointing, one window of 3 and 2 microbatches: exact today."""
    _exact_case(today, "plain")


def test_accumulator_on_activation_checkpointed_blocks(today: dict[str, dict[str, Any]]) -> None:
    """Checkpointed blocks (once refused as 'still a DTensor after every FSDP module unsharded': the accumulator
    looked the unsharded parameters up by the names CheckpointWrapper strips)."""
    _exact_case(today, "activation checkpointing")


def test_accumulator_on_the_full_dtensor_backend(today: dict[str, dict[str, Any]]) -> None:
    """full_dtensor: every parameter a DTensor on the dense mesh, still one after unshard() (once refused as 'still a
    DTensor after every FSDP module unsharded')."""
    _exact_case(today, "full_dtensor")


def test_accumulator_on_full_dtensor_with_activation_checkpointing(today: dict[str, dict[str, Any]]) -> None:
    """torchtitan's defaults for a DTensor run: checkpointed blocks on the full_dtensor backend."""
    _exact_case(today, "full_dtensor, activation checkpointing")


def test_accumulator_after_torchtitan_zero_grad_set_to_none_false(today: dict[str, dict[str, Any]]) -> None:
    """Two windows with torchtitan's zero_grad(set_to_none=False) between them: its exact zeros count as absent (once
    refused as 'already has a gradient when the accumulation window opens')."""
    _exact_case(today, "zero_grad(set_to_none=False)")


def test_clip_before_an_attached_finish_is_right_or_refused(today: dict[str, dict[str, Any]]) -> None:
    """attach(trainer.optimizers), torchtitan's clip_grad_norm_ while the window is open, then the step. Today the clip
    sees no gradient and the step applies the unclipped one, silently (error ~2.5): it must be right or raise."""
    result = today["attach and clip"]
    if "refused" in result:
        assert "clip" in result["refused"], result
    else:
        _exact_case(today, "attach and clip")


def test_example_ends_training_when_the_data_ends_with_a_full_window(runs: list[dict[str, Any]]) -> None:
    """Two full windows and no data left: both exact, and the third step raises DataloaderExhaustedError on every
    rank (torchtitan's own signal to end training), not gradagg's M = 0."""
    _check_steps(_exact(runs, KEYS[0], "exact boundary")["steps"], 2)
    assert [r[KEYS[0]]["exact boundary"]["ended"] for r in runs] == [2, 2]
