"""Benchmark: a Hugging Face Trainer optimizer step with ``gradagg.integrations.transformers.exact`` against the
same Trainer without it.

One process (no DDP: on this 2-core machine shared with other jobs, two ranks' timings drift more than the
difference measured), 1 torch thread. A ``LlamaForCausalLM`` built from a config (hidden 256, 4 layers, vocab
2048, about 5 M parameters, float32), right-padded sequences of 32 to 256 tokens with prompt and padding labels
-100, ``per_device_train_batch_size=4``, ``gradient_accumulation_steps=4``, ``max_grad_norm=1.0`` (the clip on),
AdamW, logging every step. Each round builds both trainers with the same seed and data and trains each for the
same number of optimizer steps, in alternating order (plain first in even rounds, exact first in odd ones). A
step is timed from the Trainer's ``on_step_begin`` to its ``on_step_end`` callback (the window's forwards and
backwards, the clip, the optimizer step); the first step of every ``train()`` is a warm-up and not counted.

Reported: the median step of each, the ratio of medians, the median of the rounds' ratios (each round's median
exact step over its median plain step) and the median of the paired steps' ratios (the same round's step k of
each form: the same sequences). Target (issue 14): at most 1.05.

Run: ``flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_hf.py`` (``--quick``: a tiny model, one
round of 2 steps each: a smoke run, used by the tests).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from gradagg.integrations.transformers import exact  # noqa: E402

PER_DEVICE, WINDOW = 4, 4


def model_config(quick: bool) -> Any:
    from transformers import LlamaConfig

    if quick:
        return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def rows(count: int, vocab: int, longest: int, seed: int = 5) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(min(32, longest // 2), longest)
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        prompt = rng.randint(1, n // 4)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def collate(seqs: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(s["input_ids"]) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(s["input_ids"]), torch.tensor(s["labels"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


def train(form: str, steps: int, quick: bool) -> list[float]:
    """One train() of ``steps`` optimizer steps; the step times after the first."""
    from transformers import LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments

    config = model_config(quick)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    data = rows(steps * WINDOW * PER_DEVICE, config.vocab_size, config.max_position_embeddings)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=PER_DEVICE,
                                 gradient_accumulation_steps=WINDOW, max_steps=steps, learning_rate=1e-4,
                                 max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no",
                                 use_cpu=True, disable_tqdm=True, seed=7, lr_scheduler_type="constant",
                                 dataloader_num_workers=0, log_level="error")
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        if form == "exact":
            exact(trainer)
        trainer.remove_callback(PrinterCallback)  # the logs are computed (logging_steps=1), not printed
        timer = step_timer()
        trainer.add_callback(timer)
        trainer.train()
    return timer.times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--steps", type=int, default=4,
                        help="optimizer steps per train(), the first a warm-up (default 4)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round of 3 steps: a smoke run")
    opts = parser.parse_args()
    rounds, steps = (1, 3) if opts.quick else (opts.rounds, opts.steps)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    load = os.getloadavg()
    times: dict[str, list[float]] = {"plain": [], "exact": []}
    round_ratios, paired = [], []
    for r in range(rounds):
        order = ("plain", "exact") if r % 2 == 0 else ("exact", "plain")
        got = {form: train(form, steps, opts.quick) for form in order}
        for form in order:
            times[form].extend(got[form])
        round_ratios.append(statistics.median(got["exact"]) / statistics.median(got["plain"]))
        paired.extend(e / p for e, p in zip(got["exact"], got["plain"], strict=True))  # the same step's data
        print(f"round {r}: plain {statistics.median(got['plain']) * 1e3:.1f} ms, exact "
              f"{statistics.median(got['exact']) * 1e3:.1f} ms, ratio {round_ratios[-1]:.3f}", flush=True)
    plain, ex = statistics.median(times["plain"]), statistics.median(times["exact"])
    print()
    print("| what | median step | min | ratio of medians | median of rounds' ratios | median of paired steps' "
          "ratios | target |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print(f"| Trainer step, plain | {plain * 1e3:.1f} ms | {min(times['plain']) * 1e3:.1f} ms | 1 (baseline) | - | - "
          "| - |")
    print(f"| Trainer step, exact(trainer) | {ex * 1e3:.1f} ms | {min(times['exact']) * 1e3:.1f} ms | "
          f"{ex / plain:.3f} | {statistics.median(round_ratios):.3f} | {statistics.median(paired):.3f} | <= 1.05 |")
    params = sum(p.numel() for p in __import__("transformers").LlamaForCausalLM(model_config(opts.quick)).parameters())
    print()
    print(f"Model: LlamaForCausalLM, {params / 1e6:.2f} M parameters, float32; {PER_DEVICE} sequences per "
          f"microbatch, {WINDOW} microbatches per step, max_grad_norm 1.0; one process, 1 torch thread. "
          f"{rounds} rounds x {steps - 1} timed steps per form (after 1 warm-up step per train()), interleaved. "
          f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}; "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; load average before the run: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")


if __name__ == "__main__":
    main()
