"""gradagg.integrations.accelerate on 2 gloo ranks, against the float64 one-process full batch of each step.

One world runs every case (Accelerate and transformers import slowly): the tiny Llama, an Accelerate-prepared
DataLoader of 10 microbatches of 2 right-padded sequences (5 per rank: a window of 3, then the short last window
of 2), two epochs, token counts that differ per rank and step, Accelerate's defaults (``cpu=True``: on a CPU
machine without it each rank would train alone; its DDP broadcasting buffers).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import accel  # noqa: E402

# float32 round-off: each gradient element is a sum over a few hundred tokens' float32 terms, reduced in float32
# over 2 ranks, then divided once; observed relative errors stay below 1e-6, and every wrong divisor is off by
# more than 10%.
TOLERANCE = 1e-5
CLIP = 0.6  # between the two steps' true gradient norms (asserted): the second step clipped, the first not
CASES = [("exact", None), ("exact", CLIP), ("two", CLIP), ("plain", None), ("native", None), ("native", CLIP)]


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    return run_local_world(accel.accelerate_world, 2, CASES, timeout_s=240.0, collective_timeout_s=30.0,
                           preload=["torch._dynamo"])[0]


def test_accelerate_runs_ddp_on_both_ranks(world: dict[str, Any]) -> None:
    """What Accelerate really built: DDP over 2 CPU processes, and every step saw both ranks' sequences."""
    for loop, clip in CASES:
        case = world[f"{loop}/{clip}"]
        assert case["model"] == "DistributedDataParallel" and case["distributed_type"].endswith("MULTI_CPU")
        assert case["sequences"] == [12, 8, 12, 8]  # 2 epochs: windows of 3 and 2 microbatches of 2 sequences, 2 ranks


@pytest.mark.parametrize("loop", ["exact", "plain"])
def test_every_step_is_the_full_batch_token_mean(world: dict[str, Any], loop: str) -> None:
    """accelerator.backward(loss_sum) and loss_sum.backward() inside acc.microbatch(weight=tokens): exact."""
    errors = world[f"{loop}/None"]["errors"]
    assert (world[f"{loop}/None"]["sync_during"], world[f"{loop}/None"]["sync_after"]) == (False, True)
    assert len(errors) == 4 and max(errors) < TOLERANCE, errors


def test_clip_grad_norm_clips_the_exact_gradient(world: dict[str, Any]) -> None:
    """accelerator.clip_grad_norm_ after the sync microbatch scales the finished gradient by c / ||g||."""
    case = world[f"exact/{CLIP}"]
    assert min(case["true_norms"]) < CLIP < max(case["true_norms"])
    assert max(case["errors"]) < TOLERANCE, case["errors"]


def test_two_optimizers(world: dict[str, Any]) -> None:
    """exact(accelerator, model, [matrices' optimizer, the rest's]), both prepared: each step, clipped once over
    all parameters, sees the exact clipped gradient in both optimizers."""
    case = world[f"two/{CLIP}"]
    assert case["model"] == "DistributedDataParallel" and case["sequences"] == [12, 8, 12, 8]
    assert max(case["errors"]) < TOLERANCE, case["errors"]


@pytest.mark.parametrize("clip", [None, CLIP])
def test_accelerates_own_recipe_is_wrong(world: dict[str, Any], clip: float | None) -> None:
    """Accelerate's documented accumulate() recipe with the model's mean loss: the mean of microbatch means, the
    short last window still divided by 3; the issue measured 0.57, these sequences give more than 0.3."""
    errors = world[f"native/{clip}"]["errors"]
    assert min(errors) > 0.3, errors


def test_accumulate_inside_the_microbatch_is_refused(world: dict[str, Any]) -> None:
    assert world["refused_nested"].startswith("WindowError: accelerator.accumulate() was entered inside")


def test_imports_stay_light() -> None:
    """``import gradagg``, ``gradagg.integrations`` and ``gradagg.integrations.accelerate`` import no framework
    (the accelerate module works on the objects the caller built)."""
    code = ("import sys, gradagg, gradagg.integrations, gradagg.integrations.accelerate\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'accelerate', 'lightning', 'transformers'}))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


def test_a_launcher_world_run_as_one_process_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """WORLD_SIZE 2 in the environment, an Accelerator of one process (what Accelerate builds under torchrun on
    a CPU machine without cpu=True): refused, naming cpu=True, before anything is built."""
    from types import SimpleNamespace

    import torch

    from gradagg.errors import GradaggError
    from gradagg.integrations.accelerate import exact

    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = SimpleNamespace(distributed_type="DistributedType.NO", num_processes=1)
    model = torch.nn.Linear(2, 1)
    optimizer = SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(GradaggError, match=r"WORLD_SIZE is 2 .*Accelerator\(cpu=True\)"):
        exact(alone, model, optimizer)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(GradaggError, match="not the AcceleratedOptimizer"):
        exact(alone, model, optimizer.optimizer)


def test_two_optimizers_sharing_a_parameter_are_refused() -> None:
    """exact() with two optimizers that share a parameter: refused at attach, naming it, and the accumulator it
    built is closed (the model is free for the next exact()); a list holding something else names its place."""
    from types import SimpleNamespace

    import torch

    from gradagg.errors import GradaggError
    from gradagg.integrations.accelerate import exact

    class Prepared:  # what exact() reads of an AcceleratedOptimizer: the torch optimizer inside
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    alone = SimpleNamespace(distributed_type="DistributedType.NO", num_processes=1)
    model = torch.nn.Linear(2, 1)
    first, second = Prepared(torch.optim.SGD(model.parameters(), lr=0.1)), Prepared(torch.optim.Adam([model.weight]))
    with pytest.raises(GradaggError, match="already attached over parameter 'weight'"):
        exact(alone, model, [first, second])
    exact(alone, model, [first]).close()
    with pytest.raises(GradaggError, match=r"optimizer\[1\] is a Linear, not the AcceleratedOptimizer"):
        exact(alone, model, [first, model])


@pytest.fixture(scope="module")
def world_bf16() -> dict[str, Any]:
    return run_local_world(accel.accelerate_world, 2, [("exact", None), ("native", None)], "bf16", timeout_s=240.0,
                           collective_timeout_s=30.0, preload=["torch._dynamo"])[0]


# bf16 autocast rounds the forward's and backward's matmuls to 8 significant bits (2**-8 ~ 4e-3 per rounding); the
# window's sums stay float32. Observed 3e-3 to 5e-3 against the float64 truth without autocast; Accelerate's own
# recipe stays off by its weighting (> 0.3, as in float32).
BF16_TOLERANCE = 2e-2


def test_accelerates_bf16_switch_is_exact_within_the_round_off(world_bf16: dict[str, Any]) -> None:
    """Accelerator(mixed_precision="bf16") with exact(): every step the full-batch token mean within bf16's round-off,
    far closer than Accelerate's own recipe under the same switch."""
    ours, native = world_bf16["exact/None"]["errors"], world_bf16["native/None"]["errors"]
    assert len(ours) == 4 and max(ours) < BF16_TOLERANCE, ours
    assert min(ours) > 1e-5, ours  # bf16's round-off is there: the switch acted (float32 stays below 1e-6)
    assert min(native) > 0.3, native


FSDP1_CASES = [("exact", True, None), ("exact", False, CLIP), ("native", True, None)]


@pytest.fixture(scope="module")
def world_fsdp1() -> dict[str, Any]:
    from tests.integrations.workers import accel_fsdp1

    return run_local_world(accel_fsdp1.accelerate_fsdp1_world, 2, FSDP1_CASES, timeout_s=240.0,
                           collective_timeout_s=30.0, preload=["torch._dynamo"])[0]


def test_accelerates_fsdp1_path_is_the_full_batch_token_mean(world_fsdp1: dict[str, Any]) -> None:
    """Accelerate's FSDP1 plugin (fsdp_version=1, its transformer auto-wrap policy), its state set as on a GPU (see
    the worker): Accelerate's prepare builds FSDP1 (the root and one unit per decoder layer), its accumulate()
    enters FSDP1's no_sync() between syncs, its clip_grad_norm_ is FSDP1's. With exact(), use_orig_params True and
    False, clipped and not: every step the full-batch token mean (float32, as the DDP cases: below 1e-5);
    Accelerate's own recipe on the same FSDP1 model is off by its weighting (a mean of microbatch means)."""
    for loop, orig, clip in FSDP1_CASES:
        case = world_fsdp1[f"{loop}/{orig}/{clip}"]
        assert (case["model"], case["units"]) == ("FullyShardedDataParallel", 3), case
        assert case["distributed_type"].endswith("FSDP") and case["sequences"] == [12, 8, 12, 8], case
        if loop == "exact":
            assert max(case["errors"]) < TOLERANCE, case
        else:
            assert min(case["errors"]) > 0.3, case
    clipped = world_fsdp1[f"exact/False/{CLIP}"]
    assert min(clipped["true_norms"]) < CLIP < max(clipped["true_norms"])
