"""Hugging Face Trainer with ``deepspeed=`` a ZeRO config, on every rank of a 2-rank gloo world (DeepSpeed's CPU
accelerator, float32, torch's SGD at a constant learning rate of 1: the applied gradient is the parameters' change).

The tiny Llama of :mod:`tests.integrations.tiny_llama`, trained for one epoch as in :mod:`hf`: 5 microbatches of 2
sequences per rank, ``gradient_accumulation_steps`` 3, so a window of 3 and the epoch's short last window of 2, with
token counts that differ per microbatch. DeepSpeed steps inside the backward of the window's last microbatch, so the
gradient is read as the change of the whole float32 parameters between ``on_step_begin`` and ``on_step_end``; rank 0
computes the float64 truth of the window's sequences of both ranks at the parameters the window started from.
"""

from __future__ import annotations

import copy
import functools
import math
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import deepspeed_zero as dz
from tests.integrations.workers import hf

LR = 1.0


def stage_world(stage: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case (``exact``, ``clip``, ``avg_tokens``, ``bad`` as in :func:`hf.bad_count`, ``window``: the
    TrainingArguments' gradient_accumulation_steps, which fills the config's ``"auto"``, 3 unless given; ``bf16``:
    the Trainer's ``bf16=True``, which fills the config's ``"bf16": {"enabled": "auto"}``) under ZeRO ``stage``,
    one after the other on this rank."""
    hf.launcher_environment()
    dz.no_shared_memory_op()
    return [_case(stage, case) for case in cases]


def _deepspeed_state() -> None:
    """Accelerate's process state for DeepSpeed over gloo, made before the TrainingArguments, which reuse it
    (``use_configured_state``).

    TrainingArguments under ``deepspeed=`` names no backend, and on a machine without an accelerator Accelerate then
    finds none and counts one process; given ``backend="gloo"`` it counts the world the harness started.
    """
    import os

    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    # Accelerate's private reset, as TrainingArguments itself does without use_configured_state: each case's
    # Trainer creates the first Accelerator, which alone takes a DeepSpeed plugin (test-only)
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what TrainingArguments sets around its own PartialState
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def _config(stage: int) -> dict[str, Any]:
    # no train_batch_size: "auto" fills it with TrainingArguments.world_size, 1 in a world the harness started;
    # "bf16": "auto" as Hugging Face's DeepSpeed configs write it: TrainingArguments.bf16 fills it
    return {"train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def _trainer(stage: int, case: dict[str, Any], out: str) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=hf.PER_DEVICE,
        gradient_accumulation_steps=case.get("window", hf.WINDOW),
        num_train_epochs=1, learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=case.get("clip", 0.0), logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=7, average_tokens_across_devices=case.get("avg_tokens", True), ddp_timeout=60,
        deepspeed=_config(stage), accelerator_config={"use_configured_state": True},  # see _deepspeed_state
        # TrainingArguments refuses bf16 without a bf16 GPU unless use_cpu, as a user on CPU must write it
        **({"bf16": True, "use_cpu": True} if case.get("bf16") else {}),
    )
    return Trainer(model=tl.model(0), args=args, train_dataset=hf.dataset_rows(), data_collator=tl.collate)


def _case(stage: int, case: dict[str, Any]) -> dict[str, Any]:
    from gradagg.integrations.transformers import exact

    _deepspeed_state()
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(stage, case, out)
        if case.get("bad"):
            exact(trainer, weight=hf.bad_count(case["bad"]))
        elif case.get("exact"):
            exact(trainer)
        rec = hf.Recorder()
        inner = trainer.training_step

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            rec.pending.append(hf._unpad(inputs))  # a microbatch's sequences (bf16: its own gradient, see _score)
            return inner(model, inputs, num_items_in_batch)

        trainer.training_step = training_step
        windows: list[dict[str, Any]] = []
        trainer.add_callback(_callback_class()(rec, windows))
        try:
            trainer.train()
        except Exception as exc:  # a refusal: every rank must raise it, none may hang
            return {"refused": f"{type(exc).__name__}: {exc}", "steps": trainer.state.global_step,
                    "engine_steps": trainer.model_wrapped.global_steps}
        engine = trainer.model_wrapped
        summary = {"engine": type(engine).__name__, "stage": int(engine.zero_optimization_stage()),
                   "steps": trainer.state.global_step, "engine_steps": engine.global_steps,
                   "dtype": str(next(engine.module.parameters()).dtype)}
    if dist.get_rank() != 0:
        return {}
    return {**summary, "logs": rec.logs,
            "windows": [_score(w, case.get("clip", 0.0), case.get("bf16", False)) for w in windows]}


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole and float64 (a collective under ZeRO-3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().double().clone() for n, p in model.named_parameters()}


@functools.cache
def _callback_class() -> type:
    from transformers import TrainerCallback

    class WindowCallback(TrainerCallback):  # type: ignore[misc]
        """The parameters at each window's start and end, and the window's sequences of both ranks."""

        def __init__(self, rec: hf.Recorder, windows: list[dict[str, Any]]) -> None:
            self.rec, self.windows = rec, windows
            self.before: dict[str, torch.Tensor] = {}

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.before = _full(kw["model"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            mine, self.rec.pending = self.rec.pending, []
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            microbatches = [mb for part in every for mb in part]
            self.windows.append({"before": self.before, "after": _full(kw["model"]), "microbatches": microbatches,
                                 "seqs": [s for mb in microbatches for s in mb]})

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.rec.logs.append(dict(logs))

    return WindowCallback


def _score(window: dict[str, Any], clip: float, bf16: bool) -> dict[str, Any]:
    """The applied gradient against the float64 token mean of the window's sequences (clipped as DeepSpeed clips:
    by clip / (norm + 1e-6) when that is below 1, torch's coefficient). ``bf16``: the truth is taken at the bf16
    parameters the forward ran with (DeepSpeed's bf16 copy of its float32 master weights), and beside it ``floor``,
    the error of each microbatch's bf16 gradient (at those parameters, in one process) summed exactly, in float64,
    which no accumulation can beat, and ``added``, the applied gradient's error against that exact sum."""
    model = tl.model(0)
    at = {n: t.to(torch.bfloat16) if bf16 else t for n, t in window["before"].items()}
    model.load_state_dict({n: t.float() for n, t in at.items()}, strict=False)
    want = tl.truth(model, window["seqs"])
    norm = math.sqrt(sum(float((g * g).sum()) for g in want.values()))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    got = {n: (window["before"][n] - window["after"][n]) / LR for n in want}
    out = {"error": tl.relative_error(got, {n: g * coef for n, g in want.items()}), "norm": norm,
           "loss": hf.true_loss(model, window["seqs"]), "sequences": len(window["seqs"])}
    if bf16:
        ref = _bf16_sum(model, window["microbatches"])
        ref_norm = math.sqrt(sum(float((g * g).sum()) for g in ref.values()))
        ref_coef = min(1.0, clip / (ref_norm + 1e-6)) if clip > 0 else 1.0
        ref = {n: g * ref_coef for n, g in ref.items()}
        out.update(floor=tl.relative_error(ref, {n: g * coef for n, g in want.items()}),
                   added=tl.relative_error(got, ref))
    return out


def _bf16_sum(model: torch.nn.Module, microbatches: list[list[dict[str, list[int]]]]) -> dict[str, torch.Tensor]:
    """Each microbatch's gradient of its token-summed loss, computed in bf16 as on its rank (the same padded
    batch), summed exactly in float64 and divided by the window's tokens."""
    narrow = copy.deepcopy(model).to(torch.bfloat16)
    total = sum(tl.tokens(tl.collate([s])) for mb in microbatches for s in mb)
    out: dict[str, torch.Tensor] = {}
    for mb in microbatches:
        narrow.zero_grad(set_to_none=True)
        tl.token_sum_loss(narrow, tl.collate(mb)).backward()  # type: ignore[no-untyped-call]
        for n, p in narrow.named_parameters():
            if p.grad is not None:
                out[n] = out.get(n, 0) + p.grad.double() / total
    return out
