"""What the frameworks' fp16 switches build on a CPU machine, in one process with no process group (see
``tests/integrations/test_fp16_switches.py``): Accelerate's ``mixed_precision="fp16"``, the Hugging Face Trainer's
``fp16=True`` (one window under ``exact(trainer)``, against the float64 truth) and Lightning's ``"16-mixed"``."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import hf

ROWS = 6  # one window: 3 microbatches of 2 sequences


def fp16_switches() -> dict[str, Any]:
    """Each framework's answer, as plain values."""
    return {"accelerate": _accelerate(), "trainer": _trainer(), "lightning": _lightning()}


def _accelerate() -> dict[str, Any]:
    """``Accelerator(cpu=True, mixed_precision="fp16")``: its scaler, and the dtype a Linear computes in under its
    ``autocast()``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate's private reset (test-only)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    with accelerator.autocast():
        out = model(torch.randn(3, 4))
    said = {"mixed_precision": accelerator.mixed_precision, "scaler": accelerator.scaler is not None,
            "dtype": str(out.dtype)}
    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer below builds its own
    return said


def _trainer() -> dict[str, Any]:
    """``TrainingArguments(fp16=True, use_cpu=True)`` under ``exact(trainer)``: one window of 3 microbatches (lr 0:
    the gradient at ``on_pre_optimizer_step`` is that of the seeded model), its error against the float64 token
    mean of all 6 sequences, the dtypes the LM head computed in, and the Accelerator's scaler."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradagg.integrations.transformers import exact

    grads: dict[str, torch.Tensor] = {}

    class Grads(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            grads.update({n: p.grad.detach().clone() for n, p in kw["model"].named_parameters()})

    rows = hf.dataset_rows()[:ROWS]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=3,
                                 max_steps=1, learning_rate=0.0, report_to="none", save_strategy="no",
                                 use_cpu=True, disable_tqdm=True, fp16=True, max_grad_norm=0.0)
        trainer = Trainer(model=tl.model(0), args=args, train_dataset=rows, data_collator=tl.collate,
                          callbacks=[Grads()])
        exact(trainer)
        dtypes: set[str] = set()
        trainer.model.lm_head.register_forward_hook(lambda m, i, o: dtypes.add(str(o.dtype)))
        trainer.train()
        scaler = trainer.accelerator.scaler is not None
    return {"scaler": scaler, "dtypes": sorted(dtypes), "steps": trainer.state.global_step,
            "error": tl.relative_error(grads, tl.truth(tl.model(0), rows))}


def _lightning() -> dict[str, Any]:
    """``Trainer(accelerator="cpu", precision="16-mixed")``: the precision it runs, and what it warned."""
    import lightning.pytorch as pl

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = pl.Trainer(accelerator="cpu", devices=1, precision="16-mixed", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return {"precision": trainer.precision, "warnings": [str(w.message) for w in seen]}
