"""gradagg.integrations.lightning.ExactAccumulation on 2 gloo ranks, against the float64 full batch of each step.

One world runs every case (Lightning and transformers import slowly): the tiny Llama, automatic optimisation,
``accumulate_grad_batches=3``, 10 microbatches of 2 right-padded sequences (5 per rank: a window of 3, then the
short last window of 2 at the epoch's end), token counts that differ per rank and step, on ``DDPStrategy`` and on
``ModelParallelStrategy`` with ``fully_shard`` (FSDP2) applied in ``configure_model``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import lightning as lw  # noqa: E402

# float32 round-off: each gradient element is a sum over a few hundred tokens' float32 terms, reduced in float32
# over 2 ranks, then divided once; observed relative errors stay below 1e-6, and every wrong divisor is off by
# more than 10%.
TOLERANCE = 1e-5
CLIP = 0.6  # between the two steps' true gradient norms (asserted): the first step unclipped, the second clipped
EXACT = [("ddp", "dict", None), ("ddp", "dict", CLIP), ("ddp", "fn", None), ("fsdp2", "dict", CLIP)]
NATIVE = [("ddp", "native", None), ("ddp", "native", CLIP), ("fsdp2", "native", CLIP)]
BF16 = [("ddp-bf16", "dict", CLIP), ("ddp-bf16", "native", CLIP)]  # precision="bf16-mixed"
# bf16 autocast rounds the forward's and backward's matmuls to 8 significant bits (2**-8 ~ 4e-3 per rounding); the
# window's sums stay float32: within BF16_TOLERANCE of the float64 truth without autocast.
BF16_TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    cases = [*EXACT, *NATIVE, ("ddp", "noweight", None), *BF16]
    return run_local_world(lw.lightning_world, 2, cases, timeout_s=240.0, collective_timeout_s=30.0,
                           preload=["torch._dynamo"])[0]


def _key(strategy: str, loop: str, clip: float | None) -> str:
    return f"{strategy}/{loop}/{clip}"


def _id(case: tuple[str, str, float | None]) -> str:
    return _key(*case)


def test_the_strategies_are_what_they_say(world: dict[str, Any]) -> None:
    """DDPStrategy wraps the module in DDP; ModelParallelStrategy leaves it, its parameters sharded DTensors."""
    for case in EXACT + NATIVE:
        got = world[_key(*case)]
        want = ("DistributedDataParallel", False) if case[0] == "ddp" else ("TinyLlama", True)
        assert (got["model"], got["sharded"]) == want
        assert got["sequences"] == [12, 8, 12, 8]  # 2 epochs of windows of 3 and 2 microbatches of 2 sequences, 2 ranks


@pytest.mark.parametrize("case", EXACT, ids=_id)
def test_every_step_is_the_full_batch_token_mean(world: dict[str, Any], case: tuple[str, str, float | None]) -> None:
    """With ExactAccumulation each step's gradient, after Lightning's clipping, is the (clipped) token mean."""
    got = world[_key(*case)]
    if case[2] is not None:
        assert min(got["true_norms"]) < case[2] < max(got["true_norms"])
    assert len(got["errors"]) == 4 and max(got["errors"]) < TOLERANCE, got["errors"]


@pytest.mark.parametrize("case", NATIVE, ids=_id)
def test_lightnings_own_accumulation_is_wrong(world: dict[str, Any], case: tuple[str, str, float | None]) -> None:
    """Automatic optimisation with the model's mean loss: the mean of microbatch means, the short last window
    still divided by 3; the issue measured 0.68, these sequences give more than 0.2 on every step."""
    errors = world[_key(*case)]["errors"]
    assert min(errors) > 0.2, errors


def test_a_step_without_weight_is_refused(world: dict[str, Any]) -> None:
    assert world[_key("ddp", "noweight", None)]["error"].startswith("GradaggError: ExactAccumulation: batch 0 has no")


def test_manual_optimisation_and_several_optimizers_are_refused() -> None:
    """The callback needs Lightning's automatic loop and its one optimizer; anything else is named at fit start."""
    from types import SimpleNamespace

    from gradagg.errors import GradaggError
    from gradagg.integrations.lightning import _check_fit

    automatic, manual = SimpleNamespace(automatic_optimization=True), SimpleNamespace(automatic_optimization=False)
    with pytest.raises(GradaggError, match="needs automatic optimisation"):
        _check_fit(SimpleNamespace(optimizers=[object()]), manual)  # type: ignore[arg-type]
    with pytest.raises(GradaggError, match="one optimizer; configure_optimizers gave 2"):
        _check_fit(SimpleNamespace(optimizers=[object(), object()]), automatic)  # type: ignore[arg-type]


def test_a_reused_weight_tensor_counts_each_microbatchs_own_value() -> None:
    """One process, one preallocated count that every ``training_step`` updates in place (``count.copy_(n)``)
    and returns as ``{"weight": count}``: microbatch k counts its own n (1, then 4: D = 5, the gradient
    (1 + 4) / 5 = 1 exactly); keeping the tensor counted the last n twice (D = 8, 0.625)."""
    import lightning.pytorch as pl

    from gradagg.integrations.lightning import ExactAccumulation

    counts, seen = [1.0, 4.0], {}

    class Counted(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(2))
            self.count = torch.zeros(())

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            n = counts[batch_idx]
            self.count.copy_(torch.tensor(n))
            return {"loss": self.p.sum() * n, "weight": self.count}  # d loss / d p = n: the sum over n items

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # after the callback's finish()
            seen["grad"] = None if self.p.grad is None else self.p.grad.clone()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = ExactAccumulation()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2, callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Counted(), torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1))
    assert seen["grad"] is not None and torch.equal(seen["grad"], torch.ones(2)), seen


def test_lightnings_bf16_switch_is_exact_within_the_round_off(world: dict[str, Any]) -> None:
    """precision="bf16-mixed" with ExactAccumulation: every (clipped) step the token mean within bf16's round-off;
    Lightning's own accumulation under the same switch stays off by its weighting."""
    ours, native = world[_key(*BF16[0])]["errors"], world[_key(*BF16[1])]["errors"]
    assert len(ours) == 4 and max(ours) < BF16_TOLERANCE, ours
    assert min(ours) > 1e-5, ours  # bf16's round-off is there: the switch acted (float32 stays below 1e-6)
    assert min(native) > 0.2, native


# Lightning's FSDPStrategy (FSDP1), refused by Lightning on a CPU: built by Lightning's own _setup_model through a
# subclass that lifts the refusal and gives FSDP1 device_id=cpu (see workers/lightning_fsdp1.py). Clipped by
# FSDP1's own clip_grad_norm_ in configure_gradient_clipping: Lightning's norm clip refuses this strategy.
FSDP1_CASES = [("exact", True, CLIP, "none"), ("exact", False, None, "even"), ("native", True, None, "even"),
               ("lightning-clip", True, CLIP, "even"), ("exact", True, CLIP, "even-bf16"),
               ("exact", True, None, "uneven")]


@pytest.fixture(scope="module")
def world_fsdp1() -> dict[str, Any]:
    from tests.integrations.workers import lightning_fsdp1

    return run_local_world(lightning_fsdp1.lightning_fsdp1_world, 2, FSDP1_CASES, timeout_s=240.0,
                           collective_timeout_s=30.0, preload=["torch._dynamo"])[0]


def test_fsdp_strategy_is_the_full_batch_token_mean(world_fsdp1: dict[str, Any]) -> None:
    """FSDPStrategy as Lightning builds it (FSDP1 root over the LightningModule, one unit per decoder layer,
    FULL_SHARD): with ExactAccumulation, use_orig_params True (Lightning's default, clipped by FSDP1's clip, rank 1
    with no tokens in each epoch's short window) and False (unclipped), every step the float64 token mean of the
    sequences it consumed (float32 round-off, as the DDP cases: below 1e-5); Lightning's own accumulation on the
    same FSDP1 model is off by its weighting (a mean of microbatch means, the short window divided by 3)."""
    for loop, orig, clip, plan in FSDP1_CASES[:3]:
        case = world_fsdp1[f"{loop}/{orig}/{clip}/{plan}"]
        built = (case["model"], case["units"], case["strategy"], case["orig"], case["device"])
        assert built == ("FullyShardedDataParallel", 3, "FULL_SHARD", orig, "cpu"), case
        assert case["sequences"] == [12, 8, 12, 8], case
        if loop == "exact":
            assert len(case["errors"]) == 4 and max(case["errors"]) < TOLERANCE, case
        else:
            assert min(case["errors"]) > 0.2, case
    clipped = world_fsdp1[f"exact/True/{CLIP}/none"]
    assert min(clipped["true_norms"]) < CLIP < max(clipped["true_norms"]), clipped  # one step unclipped, the rest not


def test_lightnings_norm_clip_refuses_the_fsdp_strategy(world_fsdp1: dict[str, Any]) -> None:
    """Lightning's own gradient_clip_val (norm) under FSDPStrategy raises in Lightning (FSDPPrecision), on a GPU as
    here: what the tutorial says to use instead, FSDP1's clip_grad_norm_, is what the exact case above runs."""
    error = world_fsdp1[f"lightning-clip/True/{CLIP}/even"]["error"]
    assert error.startswith("MisconfigurationException: `gradient_clip_algorithm='norm'` is currently not"), error


def test_fsdp_strategys_bf16_switch_is_exact_within_the_round_off(world_fsdp1: dict[str, Any]) -> None:
    """precision="bf16-mixed" under FSDPStrategy: FSDP1's MixedPrecision(bf16) computes and reduces each
    microbatch in bf16 (on a GPU Lightning also enters torch.autocast("cuda"), which does nothing on a CPU), the
    window's sum kept in float32: every (clipped) step within bf16's round-off of the float64 truth."""
    case = world_fsdp1[f"exact/True/{CLIP}/even-bf16"]
    assert case["param_dtype"] == "torch.bfloat16", case
    assert len(case["errors"]) == 4 and max(case["errors"]) < BF16_TOLERANCE, case
    assert min(case["errors"]) > 1e-5, case  # bf16's round-off is there: the switch acted (float32 stays below 1e-6)


def test_ranks_with_different_numbers_of_batches_are_refused(world_fsdp1: dict[str, Any]) -> None:
    """Rank 0 with 5 batches per epoch, rank 1 with 4: Lightning broadcasts at every batch and each finish() is a
    collective, so the run would meet a gloo timeout (it did, before this refusal); refused on every rank before the
    epoch's first batch, naming both counts."""
    error = world_fsdp1["exact/True/None/uneven"]["error"]
    assert error.startswith("GradaggError: ExactAccumulation: the ranks would run different numbers of batches in "
                            "epoch 0 (rank 0: 5, rank 1: 4)"), error
