"""TRL's DPOTrainer (and the trainers exact() refuses) on every rank of one world (see ``tests/torch/workers``).

DPO: the tiny Llama of :mod:`tests.integrations.tiny_llama` against a frozen copy of itself (the reference),
trained for one epoch of 5 microbatches per rank, 3 per optimizer step (a window of 3, then the short last window
of 2), from 3 preference pairs per microbatch of which a collator keeps 1, 2, 3, 1, 2: uneven pairs per microbatch
and per step (12 and 6 pairs over both ranks). A recorder captures,
at every ``on_pre_optimizer_step``, the gradient, the parameters and the pairs of the step's microbatches on both
ranks; rank 0 computes the float64 one-process truth of exactly those pairs (the mean over them of DPO's sigmoid
loss) and returns each step's relative error.

A case is a dict: ``trainer`` (``"dpo"``, ``"sft"``, ``"grpo"``, ``"rloo"``), ``exact`` (apply exact()),
``weight`` (``"len"``: ``weight=lambda inputs: len(inputs)``), ``uneven`` (``even_batches=False`` with 22 rows of 2
per microbatch: rank 0 runs 6 microbatches, rank 1 runs 5), ``loss_type`` (DPO's, a list).
"""

from __future__ import annotations

import copy
import functools
import math
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import hf

Case = dict[str, Any]
PAIRS_PER_MICROBATCH = 3
BETA = 0.5  # DPO's beta: larger than TRL's 0.1 default, so that the sigmoid's curvature shows in the gradient
UNEVEN_ROWS = 22  # 11 microbatches of 2: rank 0 runs 6, rank 1 runs 5 (Accelerate's even_batches=False)


def _words(ids: list[int]) -> str:
    return "".join(f"t{i} " for i in ids)


def pair_rows(seed: int, count: int) -> list[dict[str, str]]:
    """``count`` preference pairs as text of the test tokenizer's words (a trailing space: tokens never merge)."""
    import random

    rng = random.Random(seed)

    def some(lo: int, hi: int) -> list[int]:
        return [rng.randrange(3, tl.VOCAB) for _ in range(rng.randint(lo, hi))]

    return [{"prompt": _words(some(1, 4)), "chosen": _words(some(1, 14)), "rejected": _words(some(1, 14))}
            for _ in range(count)]


def sft_rows(count: int) -> list[dict[str, list[int]]]:
    return tl.sequences(3, count)


@functools.cache
def _collator_class() -> type:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class DroppingCollator(DataCollatorForPreference):  # type: ignore[misc]
        """Keeps 1, 2, 3, 1, 2, ... pairs of its successive microbatches: uneven per microbatch and per step, the
        same on every rank at the same microbatch (TRL's DPO gathers its per-pair rewards across ranks at every
        microbatch with ``accelerator.gather``, which needs the same number of pairs on every rank: with different
        numbers TRL's own training aborts in gloo, gradagg or not)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.calls = 0

        def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            keep, self.calls = self.calls % PAIRS_PER_MICROBATCH + 1, self.calls + 1
            return super().torch_call(examples[:keep])  # type: ignore[no-any-return]

    return DroppingCollator


def _pairs(batch: dict[str, torch.Tensor]) -> list[dict[str, list[list[int]]]]:
    """The pairs of a collated DPO microbatch: (ids, completion mask) of its chosen and its rejected row."""
    rows = []
    for ids, mask, comp in zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"]):
        n = int(mask.sum())
        rows.append([ids[:n].tolist(), comp[:n].tolist()])
    half = len(rows) // 2
    return [{"chosen": rows[i], "rejected": rows[half + i]} for i in range(half)]


class Recorder(hf.Recorder):
    """:class:`hf.Recorder` for DPO: the step's pairs instead of its sequences."""

    def wrap(self, trainer: Any) -> None:
        inner = trainer.training_step

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            self.pending.extend(_pairs(inputs))  # type: ignore[arg-type]
            return inner(model, inputs, num_items_in_batch)

        trainer.training_step = training_step
        trainer.add_callback(hf._callback(self))


def _args(case: Case, out: str, config: Any, **extra: Any) -> Any:
    options: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=2 if case.get("uneven") else PAIRS_PER_MICROBATCH,
        gradient_accumulation_steps=hf.WINDOW, num_train_epochs=1, learning_rate=0.05, max_grad_norm=0.0,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=7,
        lr_scheduler_type="constant", ddp_timeout=60, bf16=False,
    )
    if case.get("uneven"):
        options["accelerator_config"] = {"even_batches": False}
    return config(**options, **extra)


def build_trainer(case: Case, out: str) -> Any:
    from datasets import Dataset

    model, kind = tl.model(0), case["trainer"]
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        return SFTTrainer(model=model, args=_args(case, out, SFTConfig, max_length=None),
                          train_dataset=Dataset.from_list(sft_rows(UNEVEN_ROWS)), processing_class=tl.tokenizer())
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        count = UNEVEN_ROWS if case.get("uneven") else 2 * hf.MICROBATCHES * PAIRS_PER_MICROBATCH
        collator = None if case.get("uneven") else _collator_class()(pad_token_id=tl.PAD)
        args = _args(case, out, DPOConfig, max_length=None, beta=BETA, loss_type=case.get("loss_type", ["sigmoid"]))
        return DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, data_collator=collator,
                          train_dataset=Dataset.from_list(pair_rows(5, count)), processing_class=tl.tokenizer())
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    config, cls = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    args = _args(case, out, config, num_generations=2, max_completion_length=4, beta=0.0)  # no reference model
    prompts = Dataset.from_list([{"prompt": _words([5 + i, 6])} for i in range(8)])
    return cls(model=model, reward_funcs=_length_reward, args=args, train_dataset=prompts,
               processing_class=tl.tokenizer())


def _length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """An offline reward: the completion's length."""
    return [float(len(c)) for c in completions]


def run_case(case: Case) -> dict[str, Any]:
    """Train one case; return (on rank 0) each step's error and logs, or every rank's refusal."""
    from gradagg.integrations.transformers import exact

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(case, out)
        ref = copy.deepcopy(getattr(trainer, "ref_model", None))
        refused: str | None = None
        rec = Recorder()
        try:
            if case.get("exact"):
                exact(trainer, weight=(lambda inputs: len(inputs)) if case.get("weight") == "len" else None)
            rec.wrap(trainer)
            trainer.train()
        except Exception as exc:  # a refusal: every rank must raise it (gathered below), none may hang
            refused = f"{type(exc).__name__}: {exc}"
        every = hf.refusals(refused)
        if every is not None:
            return {"refused": every} if dist.get_rank() == 0 else {}
    if dist.get_rank() != 0:
        return {}
    return {"logs": rec.logs, "steps": [score(s, ref) for s in rec.steps]}


def _logp(m: torch.nn.Module, row: list[list[int]]) -> torch.Tensor:
    """The summed log-probability of a row's completion tokens (the causal shift: position t from 0..t-1)."""
    ids, comp = torch.tensor([row[0]]), torch.tensor(row[1])
    logits = m(input_ids=ids).logits[0, :-1].double()
    picked = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return (picked * comp[1:]).sum()


def pair_loss(m: torch.nn.Module, ref: torch.nn.Module, pair: dict[str, Any]) -> torch.Tensor:
    """DPO's sigmoid loss of one pair: -log sigmoid(beta * ((chosen - ref chosen) - (rejected - ref rejected)))."""
    with torch.no_grad():
        ref_c, ref_r = _logp(ref, pair["chosen"]), _logp(ref, pair["rejected"])
    delta = (_logp(m, pair["chosen"]) - ref_c) - (_logp(m, pair["rejected"]) - ref_r)
    return -F.logsigmoid(BETA * delta)


def score(step: dict[str, Any], ref: torch.nn.Module) -> dict[str, Any]:
    """One step against the float64 truth: the mean over its pairs (all microbatches, both ranks) of the loss."""
    m = tl.model(0)
    m.load_state_dict(step["params"])
    m64, ref64 = copy.deepcopy(m).double(), copy.deepcopy(ref).double()
    pairs = step["seqs"]
    total = torch.zeros((), dtype=torch.float64)
    for pair in pairs:  # one pair at a time: the truth has no microbatch
        loss = pair_loss(m64, ref64, pair) / len(pairs)
        loss.backward()
        total += loss.detach()
    want = {n: p.grad.detach().clone() for n, p in m64.named_parameters() if p.grad is not None}
    return {"error": tl.relative_error(step["grads"], want), "loss": float(total), "pairs": len(pairs),
            "norm": math.sqrt(sum(float((g * g).sum()) for g in want.values()))}


def cases_world(cases: list[Case]) -> list[dict[str, Any]]:
    """Every case in turn on this rank, in one world (transformers and TRL are imported once per rank)."""
    hf.launcher_environment()
    try:
        return [run_case(c) for c in cases]
    finally:
        dist.barrier()
