"""Hugging Face Trainer and TRL SFTTrainer cases, run on every rank of one world (see ``tests/torch/workers``).

Each case trains the tiny Llama of :mod:`tests.integrations.tiny_llama` for one epoch of 5 microbatches per rank
(2 sequences each), 3 per optimizer step: a window of 3, then the epoch's short last window of 2. A recorder
captures, at every ``on_pre_optimizer_step`` (after the clip, before the step), the gradient and the parameters it
was computed at, and which sequences the step's microbatches held (unpadded again from the attention mask); rank
0 then computes the float64 truth of exactly those sequences of both ranks and returns each step's relative error.

A case is a dict: ``exact`` (apply :func:`gradagg.integrations.transformers.exact`), ``avg_tokens``
(``average_tokens_across_devices``), ``loss_kwargs`` (the model takes them), ``trainer`` (``"sft"``: TRL's
``SFTTrainer``), ``clip`` (``max_grad_norm``), ``fsdp`` (transformers' own FSDP2: ``from_pretrained`` with
``DistributedConfig(fsdp_size=2)``), ``loss`` (a ``compute_loss_func`` of :data:`LOSS_FUNCS`: ``"tagging"``, the
mean over the unshifted labels; ``"tagging_div"`` and ``"tagging_or1"``, the same divided by
``num_items_in_batch``; ``"causal"``, transformers' causal LM loss; counted by ``weight=`` when ``weight`` is set),
``bad`` (a count that cannot count, on one rank: ``{"rank", "at", "value"}``, see :func:`bad_count`), ``rows`` (the
number of sequences, both ranks together, instead of 20) with ``even_batches`` (Accelerate's; False: a rank may run
one microbatch more), ``two`` (two optimizers in one container, :class:`TwoOptimizers`), ``bf16`` (the Trainer's
``bf16=True``; all cases of a world alike), ``fsdp1`` (``fsdp="full_shard"`` with ``fsdp_config={"version": 1}``,
``orig`` its ``use_orig_params``: the worlds of :mod:`.hf_fsdp1`, which also reads ``strategy``).
"""

from __future__ import annotations

import copy
import functools
import math
import os
import shutil
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
    if case.get("bf16"):  # the Trainer's switch: its forward under bf16 autocast (a world of its own: Accelerate's
        options["bf16"] = True  # state takes one mixed precision per process)
    if case.get("fsdp1"):  # FSDP1 through Accelerate's plugin (see .hf_fsdp1); orig: use_orig_params
        options["fsdp"] = "full_shard"
        options["fsdp_config"] = {"version": 1, "use_orig_params": case.get("orig", True), "sync_module_states": False}
    if "even_batches" in case:  # False: Accelerate deals the batches out in turn, a rank may get one more
        options["accelerator_config"] = {"even_batches": case["even_batches"]}
    if case.get("trainer") == "sft":
        from trl import SFTConfig

        # SFTConfig's default bf16=True would run the CPU forward under bfloat16 autocast: float32 here, as the truth
        return SFTConfig(**options, max_length=None, bf16=False)
    from transformers import TrainingArguments

    return TrainingArguments(**options)


def tagging_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A loss that is no causal LM's: the mean cross-entropy of every position's own label (no shift)."""
    logits = outputs.logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)


def tagging_loss_div(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """:func:`tagging_loss` written as transformers documents it: the sum divided by ``num_items_in_batch``."""
    logits = outputs.logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum") / num_items_in_batch


def tagging_loss_or1(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """:func:`tagging_loss` written defensively: the sum divided by ``num_items_in_batch or 1``."""
    logits = outputs.logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum") / (num_items_in_batch or 1)


def causal_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """transformers' own causal LM loss as a ``compute_loss_func``: divided by ``num_items_in_batch`` when given."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, vocab_size=tl.VOCAB,  # type: ignore[no-any-return]
                           num_items_in_batch=num_items_in_batch)


# compute_loss_func by case["loss"]: one that ignores num_items_in_batch, two that divide by it, transformers' own
LOSS_FUNCS = {"tagging": tagging_loss, "tagging_div": tagging_loss_div, "tagging_or1": tagging_loss_or1,
              "causal": causal_loss}


def _tagging(case: Case) -> bool:
    return str(case.get("loss", "")).startswith("tagging")


def tagging_count(inputs: Any) -> int:
    """What :func:`tagging_loss` is a mean over: the labels other than -100, unshifted."""
    return int((inputs["labels"] != -100).sum())


BAD_VALUES = {"nan": math.nan, "negative": -3.0, "inf": math.inf, "beyond_float64": 10**400}


def bad_count(bad: dict[str, Any]) -> Any:
    """The causal count, but rank ``bad["rank"]``'s microbatch number ``bad["at"]`` (from 1, over the epoch)
    counts ``BAD_VALUES[bad["value"]]`` (an int beyond float64 is handed over as it is)."""
    seen = [0]

    def count(inputs: Any) -> object:
        seen[0] += 1
        if dist.get_rank() == bad["rank"] and seen[0] == bad["at"]:
            return BAD_VALUES[bad["value"]]
        return int((inputs["labels"][:, 1:] != -100).sum())

    return count


def _model(case: Case, checkpoint: str | None) -> torch.nn.Module:
    if not case.get("fsdp"):
        return tl.model(0, loss_kwargs=case.get("loss_kwargs", True))
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    # transformers' own FSDP2: the model is sharded at load time (fully_shard per its fsdp plan), on CPU too
    assert checkpoint is not None
    return LlamaForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(fsdp_size=2))  # type: ignore[no-any-return]


def build_trainer(case: Case, out: str, checkpoint: str | None = None) -> Any:
    from transformers import Trainer

    model = _model(case, checkpoint)
    rows = tl.sequences(3, case["rows"]) if "rows" in case else dataset_rows()
    if case.get("trainer") == "sft":
        from datasets import Dataset
        from trl import SFTTrainer

        func = {"compute_loss_func": LOSS_FUNCS[case["loss"]]} if case.get("loss") else {}
        return SFTTrainer(model=model, args=training_args(case, out), train_dataset=Dataset.from_list(rows),
                          processing_class=tl.tokenizer(), **func)
    tagging = {"compute_loss_func": LOSS_FUNCS[case["loss"]]} if case.get("loss") else {}
    if case.get("two"):
        tagging["optimizers"] = (TwoOptimizers(model), None)
    return Trainer(model=model, args=training_args(case, out), train_dataset=rows, data_collator=tl.collate,
                   **tagging)


class TwoOptimizers(torch.optim.Optimizer):
    """Two optimizers as a Trainer holds them (it holds one): a container exposing them as ``optimizers``, as
    torchtitan's ``OptimizersContainer`` does; Muon beside AdamW's split, the matrices in SGD, the rest in Adam."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = list(model.named_parameters())
        matrices = [p for n, p in named if p.ndim == 2 and "embed" not in n]
        rest = [p for n, p in named if p.ndim != 2 or "embed" in n]
        self.optimizers = [torch.optim.SGD(matrices, lr=0.05), torch.optim.Adam(rest, lr=0.01)]
        super().__init__([{"params": matrices}, {"params": rest}], {"lr": 0.05})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _apply_exact(trainer: Any, case: Case) -> None:
    from gradagg.integrations.transformers import exact

    if case.get("bad"):
        exact(trainer, weight=bad_count(case["bad"]))
    elif case.get("loss") and case.get("weight"):
        exact(trainer, weight=tagging_count if _tagging(case) else tl.tokens)
    else:
        exact(trainer)


def refusals(refused: str | None) -> list[Any] | None:
    """Every rank's refusal (None where a rank was not refused), gathered on every rank; None if no rank refused.

    A refusal must come on every rank, none hanging: the gather is what shows it."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, refused)
    return every if any(r is not None for r in every) else None


def run_case(case: Case, checkpoint: str | None = None) -> dict[str, Any]:
    """Train one case; return (on rank 0) each step's error against the truth, the logs, what wrapped the model,
    what a second exact() said after train(), and (every rank's) refusal where the case was refused."""
    from gradagg.integrations.transformers import exact

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(case, out, checkpoint)
        refused: str | None = None
        try:
            if case.get("exact"):
                _apply_exact(trainer, case)
            rec = Recorder()
            rec.wrap(trainer)
            trainer.train()
        except Exception as exc:  # a refusal: every rank must raise it (gathered below), none may hang
            refused = _message(exc)
        if refused is not None:
            every = refusals(refused)  # on every rank: a collective
            return {"refused": every} if dist.get_rank() == 0 else {}
        try:
            exact(trainer)
        except Exception as exc:
            again = _message(exc)
        else:
            again = "accepted"
        wrapped = type(trainer.model_wrapped).__name__
        dtensor = type(next(trainer.model.parameters())).__name__
    if dist.get_rank() != 0:
        return {}
    loss = tagging_sum_loss if _tagging(case) else tl.token_sum_loss
    count = tagging_count if _tagging(case) else tl.tokens
    return {"wrapped": wrapped, "param_type": dtensor, "again": again, "logs": rec.logs,
            "steps": [score(s, case.get("clip", 0.0), loss, count) for s in rec.steps]}


def tagging_sum_loss(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed :func:`tagging_loss` of ``batch``."""
    logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                             ignore_index=-100, reduction="sum")


def truth(m: torch.nn.Module, seqs: list[dict[str, list[int]]], loss: Any, count: Any) -> dict[str, torch.Tensor]:
    """float64 gradients of ``sum loss / sum count`` over ``seqs``, one process, one sequence at a time."""
    m64 = copy.deepcopy(m).double()
    m64.zero_grad(set_to_none=True)
    total = sum(count(tl.collate([s])) for s in seqs)
    for s in seqs:
        (loss(m64, tl.collate([s])) / total).backward()
    return {n: p.grad.detach().clone() for n, p in m64.named_parameters() if p.grad is not None}


def score(step: dict[str, Any], clip: float, loss: Any = tl.token_sum_loss, count: Any = tl.tokens) -> dict[str, Any]:
    """One step against the float64 truth of its sequences at its parameters (clipped as torch clips)."""
    m = tl.model(0)
    m.load_state_dict(step["params"])
    want = truth(m, step["seqs"], loss, count)
    norm = math.sqrt(sum(float((g * g).sum()) for g in want.values()))
    if clip > 0:
        coef = min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
        want = {n: g * coef for n, g in want.items()}
    worst = max(want, key=lambda n: float((step["grads"][n].double() - want[n]).abs().max()))
    return {"error": tl.relative_error(step["grads"], want), "worst": worst, "norm": norm,
            "loss": true_loss(m, step["seqs"], loss, count), "sequences": len(step["seqs"])}


def true_loss(m: torch.nn.Module, seqs: list[dict[str, list[int]]], loss: Any = tl.token_sum_loss,
              count: Any = tl.tokens) -> float:
    """The float64 mean of the loss over ``seqs``: its sum over their counted labels."""
    m64 = copy.deepcopy(m).double()
    with torch.no_grad():
        total = sum(float(loss(m64, tl.collate([s]))) for s in seqs)
    return total / sum(count(tl.collate([s])) for s in seqs)


def launcher_environment() -> None:
    """What ``torchrun`` would have set: transformers reads ``LOCAL_RANK`` to train distributed (else each rank
    trains alone, silently), Accelerate the rest; the process group itself is already initialised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def cases_world(cases: list[Case]) -> list[dict[str, Any]]:
    """Every case in turn on this rank, in one world (transformers is imported once per rank). The FSDP2 cases
    load one checkpoint of the tiny Llama, saved by rank 0 into a folder both ranks read."""
    launcher_environment()
    place = [tempfile.mkdtemp(prefix="gradagg-hf-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(place, src=0)
    checkpoint = f"{place[0]}/tiny-llama"
    try:
        if any(c.get("fsdp") for c in cases):
            if dist.get_rank() == 0:
                tl.model(0).save_pretrained(checkpoint)
            dist.barrier()
        return [run_case(c, checkpoint) for c in cases]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(str(place[0]), ignore_errors=True)
