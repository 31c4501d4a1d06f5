"""Hugging Face Trainer and TRL SFTTrainer cases, run on every rank of one world (see ``tests/torch/workers``).

Each case trains the tiny Llama of :mod:`tests.integrations.tiny_llama` for one epoch of 5 microbatches per rank
(2 sequences each), 3 per optimizer step: a window of 3, then the epoch's short last window of 2. A recorder
captures, at every ``on_pre_optimizer_step`` (after the clip, before the step), the gradient and the parameters it
was computed at, and which sequences the step's microbatches held (unpadded again from the attention mask); rank
0 then computes the float64 truth of exactly those sequences of both ranks and returns each step's relative error.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from tests.integrations import tiny_llama as tl

Case = dict[str, Any]
PER_DEVICE, WINDOW, MICROBATCHES = 2, 3, 5
WORLD: dict[str, Any] = {"collective_timeout_s": 20.0, "timeout_s": 240.0, "preload": ["torch._dynamo"]}


def dataset_rows(seed: int = 3) -> list[dict[str, list[int]]]:
    """Every rank's share of the epoch: 2 ranks x 5 microbatches x 2 sequences."""
    return tl.sequences(seed, 2 * MICROBATCHES * PER_DEVICE)


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # an FSDP2 DTensor: every rank takes part in the all-gather
    return (full() if full is not None else t).detach().clone()


def _unpad(batch: dict[str, torch.Tensor]) -> list[dict[str, list[int]]]:
    out = []
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
        n = int(mask.sum())
        out.append({"input_ids": ids[:n].tolist(), "labels": labels[:n].tolist()})
    return out


class Recorder:
    """What every optimizer step saw: its gradient, its parameters, its sequences; and the logs."""

    def __init__(self) -> None:
        self.pending: list[dict[str, list[int]]] = []
        self.steps: list[dict[str, Any]] = []
        self.logs: list[dict[str, float]] = []

    def wrap(self, trainer: Any) -> None:
        inner = trainer.training_step

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            self.pending.extend(_unpad(inputs))
            return inner(model, inputs, num_items_in_batch)

        trainer.training_step = training_step
        trainer.add_callback(_callback(self))

    def on_step(self, model: torch.nn.Module) -> None:
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        params = {n: _full(p) for n, p in model.named_parameters()}
        mine, self.pending = self.pending, []
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        self.steps.append({"grads": grads, "params": params, "seqs": [s for part in every for s in part]})


@functools.cache
def _callback_class() -> type:
    from transformers import TrainerCallback

    class RecordingCallback(TrainerCallback):  # type: ignore[misc]
        def __init__(self, rec: Recorder) -> None:
            self.rec = rec

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.rec.on_step(kw["model"])

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.rec.logs.append(dict(logs))

    return RecordingCallback


def _callback(rec: Recorder) -> Any:
    return _callback_class()(rec)


def training_args(case: Case, out: str) -> Any:
    """The Trainer's arguments of a case (``SFTConfig`` for TRL)."""
    options: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=WINDOW,
        num_train_epochs=1, learning_rate=0.05, max_grad_norm=case.get("clip", 0.0), logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=7, lr_scheduler_type="constant",
        average_tokens_across_devices=case.get("avg_tokens", True), ddp_timeout=60,
    )
    if case.get("trainer") == "sft":
        from trl import SFTConfig

        # SFTConfig's default bf16=True would run the CPU forward under bfloat16 autocast: float32 here, as the truth
        return SFTConfig(**options, max_length=None, bf16=False)
    from transformers import TrainingArguments

    return TrainingArguments(**options)


def build_trainer(case: Case, out: str) -> Any:
    from transformers import Trainer

    model = tl.model(0, loss_kwargs=case.get("loss_kwargs", True))
    rows = dataset_rows()
    if case.get("trainer") == "sft":
        from datasets import Dataset
        from trl import SFTTrainer

        return SFTTrainer(model=model, args=training_args(case, out), train_dataset=Dataset.from_list(rows),
                          processing_class=tl.tokenizer())
    return Trainer(model=model, args=training_args(case, out), train_dataset=rows, data_collator=tl.collate)


def run_case(case: Case) -> dict[str, Any]:
    """Train one case; return (on rank 0) each step's error against the truth, the logs, what wrapped the model."""
    from gradagg.integrations.transformers import exact

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(case, out)
        if case.get("exact"):
            exact(trainer)
        rec = Recorder()
        rec.wrap(trainer)
        trainer.train()
        wrapped = type(trainer.model_wrapped).__name__
        dtensor = type(next(trainer.model.parameters())).__name__
    if dist.get_rank() != 0:
        return {}
    return {"wrapped": wrapped, "param_type": dtensor, "steps": [score(s, case.get("clip", 0.0)) for s in rec.steps],
            "logs": rec.logs}


def score(step: dict[str, Any], clip: float) -> dict[str, float]:
    """One step against the float64 truth of its sequences at its parameters (clipped as torch clips)."""
    m = tl.model(0)
    m.load_state_dict(step["params"])
    want = tl.truth(m, step["seqs"])
    norm = math.sqrt(sum(float((g * g).sum()) for g in want.values()))
    if clip > 0:
        coef = min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
        want = {n: g * coef for n, g in want.items()}
    worst = max(want, key=lambda n: float((step["grads"][n].double() - want[n]).abs().max()))
    return {"error": tl.relative_error(step["grads"], want), "worst": worst, "norm": norm,
            "loss": true_loss(m, step["seqs"]), "sequences": len(step["seqs"])}


def true_loss(m: torch.nn.Module, seqs: list[dict[str, list[int]]]) -> float:
    """The float64 token mean of the loss over ``seqs``."""
    m64 = copy.deepcopy(m).double()
    with torch.no_grad():
        total = sum(float(tl.token_sum_loss(m64, tl.collate([s]))) for s in seqs)
    return total / sum(tl.tokens(tl.collate([s])) for s in seqs)


def launcher_environment() -> None:
    """What ``torchrun`` would have set: transformers reads ``LOCAL_RANK`` to train distributed (else each rank
    trains alone, silently), Accelerate the rest; the process group itself is already initialised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def cases_world(cases: list[Case]) -> list[dict[str, Any]]:
    """Every case in turn on this rank, in one world (transformers is imported once per rank)."""
    launcher_environment()
    return [run_case(c) for c in cases]
