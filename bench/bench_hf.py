"""Benchmark: a Hugging Face Trainer optimizer step with ``gradagg.integrations.transformers.exact`` against the
same Trainer without it.

One process (no DDP: on this 2-core machine shared with other jobs, two ranks' timings drift more than the
difference measured), 1 torch thread, the two trainers in lockstep. A ``LlamaForCausalLM`` built from a config
(hidden 256, 4 layers, vocab 2048, 4.0 M parameters, float32), right-padded sequences of 32 to 256 tokens with
prompt and padding labels -100, ``per_device_train_batch_size=4``, ``gradient_accumulation_steps=4``,
``max_grad_norm=1.0`` (the clip on), AdamW, logging every step. Each round builds both trainers with the same seed
and data and runs their ``train()`` in two threads taking strict turns (:class:`Turns`): plain step 1, exact step
1, plain step 2, ... (exact first in odd rounds), so that the machine's load, which other jobs change from second
to second, falls on both alike. A step is timed from the Trainer's ``on_step_begin`` to its ``on_step_end``
callback (the window's forwards and backwards, the clip, the optimizer step); the first step of every ``train()``
is a warm-up and not counted. While the exact trainer's accumulator is alive, gradagg's clip and optimizer-step
guard (one check per call, global to the process) also wraps the plain trainer's clip and step.

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
import threading
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


class Turns:
    """Strict turn-taking between the two trainers' threads: one runs, the other waits in a callback.

    A thread holds its turn from ``on_train_begin`` (or the end of its wait) to its next ``on_log``: the whole
    step, its logging, and the fetch and ``sync_gradients`` flag of the next window (Accelerate's gradient state
    is one object shared by every Accelerator of the process, so the two trainers must never interleave inside a
    step). At ``on_log`` it hands the turn over and waits for it again, unless the other has finished.
    """

    def __init__(self, first: str) -> None:
        self.cond = threading.Condition()
        self.turn, self.done = first, set[str]()

    def wait(self, me: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.turn == me or self.done - {me}, timeout=600):
                raise RuntimeError(f"{me}: the other trainer never handed the turn back")

    def hand_over(self, me: str, other: str) -> None:
        with self.cond:
            if other not in self.done:
                self.turn = other
            self.cond.notify_all()
        if other not in self.done:
            self.wait(me)

    def finish(self, me: str, other: str) -> None:
        with self.cond:
            self.done.add(me)
            self.turn = other
            self.cond.notify_all()


def step_timer(me: str, other: str, turns: Turns) -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            turns.wait(me)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            turns.hand_over(me, other)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            turns.finish(me, other)

    return StepTimer()


def build(form: str, steps: int, quick: bool, out: str) -> Any:
    """A Trainer of ``steps`` optimizer steps; the same model, data and order for both forms."""
    from transformers import LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments

    config = model_config(quick)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    data = rows(steps * WINDOW * PER_DEVICE, config.vocab_size, config.max_position_embeddings)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=PER_DEVICE,
                             gradient_accumulation_steps=WINDOW, max_steps=steps, learning_rate=1e-4,
                             max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no",
                             use_cpu=True, disable_tqdm=True, seed=7, lr_scheduler_type="constant",
                             dataloader_num_workers=0, log_level="error")
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    if form == "exact":
        exact(trainer)
    trainer.remove_callback(PrinterCallback)  # the logs are computed (logging_steps=1), not printed
    return trainer


def lockstep(trainers: dict[str, Any], order: tuple[str, str]) -> dict[str, Any]:
    """Both trainers' ``train()`` in two threads taking strict turns, ``order[0]``'s step first; their step timers
    (a step timer added to each trainer last). A trainer's error is raised here, after both threads ended."""
    turns = Turns(order[0])
    errors: list[BaseException] = []
    timers = {}
    for me, other in (order, order[::-1]):
        timers[me] = step_timer(me, other, turns)
        trainers[me].add_callback(timers[me])

    def run(form: str) -> None:
        try:
            trainers[form].train()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)
            turns.finish(form, "")

    threads = [threading.Thread(target=run, args=(form,)) for form in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return timers


def round_of(order: tuple[str, str], steps: int, quick: bool) -> dict[str, list[float]]:
    """Both trainers in lockstep, ``order[0]``'s step first; each form's step times after its first."""
    with tempfile.TemporaryDirectory() as out:
        trainers = {form: build(form, steps, quick, os.path.join(out, form)) for form in order}
        timers = lockstep(trainers, order)
    return {form: timers[form].times[1:] for form in order}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each form first in every other (default 5)")
    parser.add_argument("--steps", type=int, default=9,
                        help="optimizer steps per train(), the first a warm-up (default 9)")
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
        got = round_of(order, steps, opts.quick)
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
          f"{rounds} rounds x {steps - 1} timed steps per form (after 1 warm-up step per train()), in lockstep. "
          f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}; "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; load average before the run: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")


if __name__ == "__main__":
    main()
