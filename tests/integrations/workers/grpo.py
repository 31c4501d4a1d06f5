"""TRL's GRPOTrainer on every rank of one world, each optimizer step against the float64 one-process truth.

The tiny Llama of :mod:`tests.integrations.tiny_llama`, saved to a directory and loaded by path (TRL builds the
reference model for ``beta != 0`` from that path), generates offline: 2 completions per prompt of at most
``MAX_COMPLETION`` tokens, sampled among the end-of-sequence token and 8 others (``suppress_tokens``), so completion
lengths differ per row, per microbatch and per rank. An offline reward (the completion's length) gives the
advantages. A recorder wraps ``compute_loss`` (after ``exact()``: it sees the microbatch TRL prepared) and keeps every
row: prompt and completion ids and masks, advantage, TRL's old and reference log-probabilities where TRL computed
them; at every ``on_pre_optimizer_step`` it gathers the step's rows of both ranks with the gradient and the
parameters. Rank 0 recomputes each step in one process in float64 (:func:`score`): GRPO's per-token clipped objective
(or CISPO's) plus ``beta`` times the KL term (times the importance ratio: TRL's default ``use_bias_correction_kl``),
aggregated over the step's rows by the ``loss_type``'s mode (:func:`mode_value`, the oracle).

A case is a dict: ``loss_type``, ``exact`` (apply exact()), ``spg`` (``steps_per_generation``), ``ga``
(``gradient_accumulation_steps``), ``iters`` (``num_iterations``), ``beta``, ``epsilon_high``, ``mask_truncated``
(``mask_truncated_completions``: fully masked completions), ``entropy_coef``, ``weight`` (pass ``weight=len``),
``seed`` (the Trainer's: the sampled completions).
"""

from __future__ import annotations

import copy
import math
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import hf

Case = dict[str, Any]
MAX_COMPLETION = 6
GENERATIONS = 2
PER_DEVICE = 2
STEPS = 2
KEPT = [tl.PAD + 2] + list(range(120, 128))  # the end-of-sequence token (t2) and 8 others: lengths 1 to 6
MODES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
         "dapo": "token-mean", "cispo": "token-mean"}


def sweep(seed: int, count: int) -> list[Case]:
    """``count`` configurations drawn from ``seed``: every loss type, window against generation batch, iterations."""
    import random

    rng = random.Random(seed)
    return [{"loss_type": rng.choice(list(MODES)), "spg": rng.randint(1, 4), "ga": rng.randint(1, 4),
             "iters": rng.choice([1, 2]), "beta": rng.choice([0.0, 0.05]), "mask_truncated": rng.random() < 0.3,
             "seed": rng.randrange(1000), "exact": True} for _ in range(count)]


def _row(inputs: dict[str, Any], i: int) -> dict[str, Any]:
    def get(key: str) -> list[Any] | None:
        value = inputs.get(key)
        return None if value is None else value[i].tolist()

    return {"prompt": get("prompt_ids"), "prompt_mask": get("prompt_mask"), "ids": get("completion_ids"),
            "mask": get("completion_mask"), "advantage": float(inputs["advantages"][i]),
            "old": get("old_per_token_logps"), "ref": get("ref_per_token_logps")}


class Recorder(hf.Recorder):
    """:class:`hf.Recorder` for GRPO: the rows of the prepared microbatches, seen in ``compute_loss``."""

    def wrap(self, trainer: Any) -> None:
        inner = trainer.compute_loss

        def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
            if model.training:
                self.pending.extend(_row(inputs, i) for i in range(inputs["completion_ids"].shape[0]))
            return inner(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

        trainer.compute_loss = compute_loss
        trainer.add_callback(hf._callback(self))


def build_trainer(case: Case, out: str) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    path = _saved_model(out)
    suppress = [t for t in range(tl.VOCAB) if t not in KEPT]
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=case.get("ga", 2),
        steps_per_generation=case.get("spg", 2), num_iterations=case.get("iters", 1), beta=case.get("beta", 0.0),
        loss_type=case["loss_type"], num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION,
        generation_kwargs={"suppress_tokens": suppress}, max_steps=STEPS, learning_rate=0.05, max_grad_norm=0.0,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        seed=case.get("seed", 7), lr_scheduler_type="constant", ddp_timeout=60, bf16=False,
        epsilon_high=case.get("epsilon_high"),
        entropy_coef=case.get("entropy_coef", 0.0), mask_truncated_completions=case.get("mask_truncated", False),
    )
    prompts = Dataset.from_list([{"prompt": f"t{5 + i} t6 "} for i in range(64)])  # 2 tokens each: no left padding
    return GRPOTrainer(model=path, reward_funcs=_length_reward, args=args, train_dataset=prompts,
                       processing_class=tl.tokenizer())


def _saved_model(out: str) -> str:
    """The tiny model saved once, by rank 0, into rank 0's directory (transformers saves on the main process)."""
    where = [f"{out}/model"]
    dist.broadcast_object_list(where, src=0)
    if dist.get_rank() == 0:
        tl.model(0).save_pretrained(where[0])
    dist.barrier()
    return where[0]


def _length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """An offline reward: the completion's length."""
    return [float(len(c)) for c in completions]


def run_case(case: Case) -> dict[str, Any]:
    """Train one case; return (on rank 0) each step's error and the logs, or every rank's refusal."""
    from gradagg.integrations.transformers import exact

    with tempfile.TemporaryDirectory() as out:
        refused: str | None = None
        rec = Recorder()
        try:
            trainer = build_trainer(case, out)
            if case.get("exact"):
                exact(trainer, weight=(lambda inputs: len(inputs)) if case.get("weight") else None)
            rec.wrap(trainer)
            trainer.train()
        except Exception as exc:  # a refusal: every rank must raise it (gathered below), none may hang
            refused = f"{type(exc).__name__}: {exc}"
        every = hf.refusals(refused)
        if every is not None:
            return {"refused": every} if dist.get_rank() == 0 else {}
        if dist.get_rank() != 0:
            return {}
        eps = (trainer.epsilon_low, trainer.epsilon_high)
        return {"logs": rec.logs, "steps": [score(s, case, eps) for s in rec.steps]}


def token_losses(m: torch.nn.Module, row: dict[str, Any], case: Case, eps: tuple[float, float]) -> torch.Tensor:
    """One completion's per-token loss in float64: GRPO's clipped surrogate (CISPO's for ``cispo``), + beta KL."""
    ids = torch.tensor([row["prompt"] + row["ids"]])
    attention = torch.tensor([row["prompt_mask"] + row["mask"]])
    n = len(row["ids"])
    logits = m(input_ids=ids, attention_mask=attention).logits[0, -n - 1:-1].double()
    logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, -n:, None])[:, 0]
    old = logp.detach() if row["old"] is None else torch.tensor(row["old"], dtype=torch.float64)
    ratio, adv = torch.exp(logp - old), row["advantage"]
    if case["loss_type"] == "cispo":
        loss = -torch.clamp(ratio, max=eps[1]).detach() * adv * logp
    else:
        loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps[0], 1 + eps[1]) * adv)
    if case.get("beta", 0.0):
        ref = torch.tensor(row["ref"], dtype=torch.float64)
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        loss = loss + case["beta"] * kl * ratio  # use_bias_correction_kl (TRL's default): times the ratio
    return loss


def mode_value(losses: list[torch.Tensor], masks: list[torch.Tensor], mode: str) -> torch.Tensor:
    """The pure-Python oracle of the modes over one step's completions (fully masked ones count in no divisor)."""
    kept = [(lo, ma) for lo, ma in zip(losses, masks, strict=True) if ma.sum() > 0]
    sums = [(lo * ma).sum() for lo, ma in kept]
    if mode == "token-mean":
        return sum(sums) / sum(float(ma.sum()) for _, ma in kept)  # type: ignore[return-value]
    if mode == "seq-mean-token-mean":
        return sum(s / float(ma.sum()) for s, (_, ma) in zip(sums, kept)) / len(kept)  # type: ignore[return-value]
    return sum(sums) / (len(kept) * MAX_COMPLETION)  # type: ignore[return-value]  # seq-mean-token-sum-norm


def score(step: dict[str, Any], case: Case, eps: tuple[float, float]) -> dict[str, Any]:
    """One step against the float64 truth: the loss_type's mode over the step's rows (all microbatches, both ranks)."""
    m = tl.model(0)
    m.load_state_dict(step["params"])
    m64 = copy.deepcopy(m).double()
    m64.eval()
    rows = step["seqs"]
    losses = [token_losses(m64, r, case, eps) for r in rows]
    masks = [torch.tensor(r["mask"], dtype=torch.float64) for r in rows]
    value = mode_value(losses, masks, MODES[case["loss_type"]])
    value.backward()
    want = {n: p.grad.detach().clone() for n, p in m64.named_parameters() if p.grad is not None}
    return {"error": tl.relative_error(step["grads"], want), "loss": float(value), "rows": len(rows),
            "lengths": [int(sum(r["mask"])) for r in rows],
            "norm": math.sqrt(sum(float((g * g).sum()) for g in want.values()))}


def cases_world(cases: list[Case]) -> list[dict[str, Any]]:
    """Every case in turn on this rank, in one world (transformers and TRL are imported once per rank)."""
    hf.launcher_environment()
    try:
        return [run_case(c) for c in cases]
    finally:
        dist.barrier()
