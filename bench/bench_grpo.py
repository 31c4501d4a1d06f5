"""Benchmark: a TRL ``GRPOTrainer`` optimizer step with ``gradagg.integrations.transformers.exact`` against TRL's own.

Time: one process, 1 torch thread, the two trainers in lockstep, as ``bench/bench_hf.py`` runs them (its
:class:`Turns` and step timer): each round builds TRL's own ``GRPOTrainer`` and the same trainer with
``exact(trainer)`` (same seed, model, prompts and order), and runs their ``train()`` in two threads taking strict
turns, one optimizer step each (TRL's first in even rounds, exact first in odd ones). A ``LlamaForCausalLM`` built
from a config (hidden 256, 4 layers, vocab 2048, 4.0 M parameters, float32), a word-level tokenizer built here, an
offline reward (the completion's length), TRL's default ``loss_type`` (``dapo``) and ``beta`` (0), 4 prompts of 4
tokens per step, 4 completions each of at most 48 tokens sampled among the end-of-sequence token and 15 others
(lengths differ per row), ``per_device_train_batch_size=4``, ``gradient_accumulation_steps=4`` (=
``steps_per_generation``: one generation per step), ``max_grad_norm=1.0``, AdamW, logging every step. The global
torch RNG is seeded with the step's number at ``on_step_begin`` (TRL samples in the step's first microbatch), so
step k of both forms generates the same completions: the same work. A step is timed from ``on_step_begin`` to
``on_step_end``: the generation, the rewards, the window's forwards and backwards, the clip, the optimizer step;
the first step of every ``train()`` is a warm-up and not counted. While the exact trainer's accumulator is alive,
gradagg's clip and optimizer-step guard (process-global) also wraps TRL's own trainer's clip and step.

Memory: peak RSS (``VmHWM``) of a fresh process per form that trains 3 steps alone, and the same less its RSS
before the model was built (the interpreter, torch, transformers, TRL): the step's own. glibc returns freed blocks
of 64 KiB or more at once (``mallopt``), so the peak is that of the tensors alive together. torch has no
allocator counters on the CPU. Beside the two trainers, a raw loop over the same model and sequences measures the
memory of a second loss term: the accumulator with one term (``microbatch(weight=tokens)``, a token mean) against
two terms counted ahead with ``divisors()`` (the token mean plus a sequence-mean-of-token-means term, each divided
by its own global count before backward, into the one gradient buffer), and a loop without the accumulator; a last
form holds one more gradient-sized buffer beside the two terms (what a term counted only after its backward would
need, not built): it shows that the measure sees such a buffer.

Reported: the median step of each form, the ratio of medians, the median of the rounds' ratios and of the paired
steps' ratios (step k of each form: the same completions); target (issue 23): at most 1.03. Then the memory rows.

Run: ``flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_grpo.py`` (``--quick``: a tiny model, one
round of 3 steps and 2-step memory runs: a smoke run, used by the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import warnings
from datetime import UTC, datetime
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

from bench_fsdp import malloc_returns_memory  # noqa: E402
from bench_hf import lockstep, model_config  # noqa: E402

from gradagg.integrations.transformers import exact  # noqa: E402

PER_DEVICE, WINDOW, GENERATIONS = 4, 4, 4
KEPT = 16  # the end-of-sequence token and 15 others may be sampled: completions of differing lengths


def completion_length(quick: bool) -> int:
    return 6 if quick else 48


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over the model's vocabulary (tokens ``t0`` ... ``t{vocab-1}``): no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t3"))
    raw.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="t0", bos_token="t1", eos_token="t2",
                                   unk_token="t3")


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """An offline reward: the completion's length."""
    return [float(len(c)) for c in completions]


def build(form: str, steps: int, quick: bool, out: str) -> Any:
    """A GRPOTrainer of ``steps`` optimizer steps; the same model, prompts and order for both forms."""
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    config = model_config(quick)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    kept = {2} | set(range(config.vocab_size - KEPT + 1, config.vocab_size))
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=WINDOW,
        num_generations=GENERATIONS, max_completion_length=completion_length(quick),
        generation_kwargs={"suppress_tokens": [t for t in range(config.vocab_size) if t not in kept]},
        max_steps=steps, learning_rate=1e-4, max_grad_norm=1.0, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=7, lr_scheduler_type="constant", bf16=False,
        dataloader_num_workers=0, log_level="error")
    prompts = Dataset.from_list([{"prompt": " ".join(f"t{4 + (7 * i + j) % 100}" for j in range(4))}
                                 for i in range(256)])  # 4 tokens each: no left padding
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=prompts,
                          processing_class=tokenizer(config.vocab_size))
    if form == "exact":
        exact(trainer)
    trainer.remove_callback(PrinterCallback)
    return trainer


def seeder() -> Any:
    """Seeds the global torch RNG with the step's number before the step's first microbatch (TRL samples there)."""
    from transformers import TrainerCallback

    class Seeder(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.manual_seed(1000 + state.global_step)

    return Seeder()


def round_of(order: tuple[str, str], steps: int, quick: bool) -> dict[str, list[float]]:
    """Both trainers in lockstep, ``order[0]``'s step first; each form's step times after its first, and under
    ``"same"`` in how many of its steps the two forms had seen the same number of tokens (TRL's ``num_tokens``, the
    prompts' and completions' tokens so far: the same work), of how many."""
    with tempfile.TemporaryDirectory() as out:
        trainers = {form: build(form, steps, quick, os.path.join(out, form)) for form in order}
        for form in order:
            trainers[form].add_callback(seeder())  # before the step timer (lockstep adds it last), as it was
        timers = lockstep(trainers, order)
        seen = {form: [log["num_tokens"] for log in trainers[form].state.log_history if "num_tokens" in log]
                for form in order}
    same = sum(a == b for a, b in zip(seen["plain"], seen["exact"], strict=True))
    return {**{form: timers[form].times[1:] for form in order}, "same": [same, len(seen["plain"])]}


def rss_mib() -> float:
    """This process's RSS now (from /proc), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``), MiB: not ``ru_maxrss``, which Linux keeps across ``execve`` (a child
    would report its parent's peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB


def loop_batches(quick: bool, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps`` windows of ``WINDOW`` microbatches: 4 prompt+completion rows, completion masks of 1 to L tokens."""
    config, length = model_config(quick), completion_length(quick)
    gen = torch.Generator().manual_seed(3)
    windows = []
    for _ in range(steps):
        window = []
        for _ in range(WINDOW):
            ids = torch.randint(3, config.vocab_size, (PER_DEVICE, 4 + length), generator=gen)
            lengths = torch.randint(1, length + 1, (PER_DEVICE, 1), generator=gen)
            mask = (torch.arange(length)[None, :] < lengths).float()
            window.append((ids, mask))
        windows.append(window)
    return windows


def token_losses(model: Any, ids: torch.Tensor, length: int) -> torch.Tensor:
    """The completion tokens' negative log-likelihoods, (rows, length)."""
    logits = model(input_ids=ids).logits[:, -length - 1:-1]
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, -length:], reduction="none")


def loop_window(form: str, model: Any, window: list[tuple[torch.Tensor, torch.Tensor]], acc: Any,
                length: int) -> None:
    """One window's forwards and backwards: without the accumulator, with one term, or with two (``divisors()``)."""
    tokens = sum(float(m.sum()) for _, m in window)
    if form.startswith("loop 2 terms"):
        div = acc.divisors({"tokens": tokens, "sequences": sum(m.shape[0] for _, m in window)})
    for ids, mask in window:
        loss = token_losses(model, ids, length)
        if form == "loop, no accumulator":
            ((loss * mask).sum() / tokens).backward()
        elif form == "loop 1 term":
            with acc.microbatch(weight=float(mask.sum())):
                (loss * mask).sum().backward()
        else:
            seq_means = (loss * mask).sum(1) / mask.sum(1)  # a second term: the mean of each sequence's token mean
            with acc.microbatch():
                ((loss * mask).sum() / div["tokens"] + seq_means.sum() / div["sequences"]).backward()
    if acc is not None:
        acc.finish()


def child(form: str, quick: bool, steps: int) -> None:
    """One form alone in this process: train ``steps`` steps; print its peak and own RSS as one JSON line."""
    malloc_returns_memory()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers import LlamaForCausalLM

    from gradagg.torch import MicrobatchAccumulator

    if form in ("plain", "exact"):
        import datasets  # noqa: F401  # imported before the baseline, as transformers and TRL are
        import trl  # noqa: F401
    before = rss_mib()
    if form in ("plain", "exact"):
        with tempfile.TemporaryDirectory() as out:
            build(form, steps, quick, out).train()
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(model_config(quick))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        acc = None if form == "loop, no accumulator" else MicrobatchAccumulator(model)
        # the stand-in form: a second gradient-sized buffer held through the steps, what a term counted only after
        # its backward would need (not built): it shows that this measure sees one
        held = torch.ones(sum(p.numel() for p in model.parameters())) if form == STAND_IN else None
        for window in loop_batches(quick, steps):
            loop_window(form, model, window, acc, completion_length(quick))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        del held
    peak = peak_rss_mib()
    print(json.dumps({"form": form, "peak": peak, "own": peak - before}))


MEMORY_FORMS = {"plain": "GRPOTrainer, TRL's own", "exact": "GRPOTrainer, exact(trainer)",
                "loop, no accumulator": "raw loop, no accumulator", "loop 1 term": "raw loop, accumulator, 1 term",
                "loop 2 terms": "raw loop, accumulator, 2 terms (divisors())",
                "loop 2 terms + buffer": "raw loop, accumulator, 2 terms + 1 gradient-sized buffer (stand-in)"}
STAND_IN = "loop 2 terms + buffer"


def memory(quick: bool, steps: int) -> dict[str, dict[str, float]]:
    """Each memory form in a fresh process, one after the other."""
    out = {}
    for form in MEMORY_FORMS:
        cmd = [sys.executable, __file__, "--child", form, "--steps", str(steps)] + (["--quick"] if quick else [])
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"memory run {form!r} failed:\n{done.stderr[-3000:]}")
        out[form] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def print_times(times: dict[str, list[float]], round_ratios: list[float], paired: list[float]) -> None:
    plain, ex = statistics.median(times["plain"]), statistics.median(times["exact"])
    print()
    print("| what | median step | min | ratio of medians | median of rounds' ratios | median of paired steps' "
          "ratios | target |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print(f"| GRPOTrainer step, TRL's own | {plain * 1e3:.1f} ms | {min(times['plain']) * 1e3:.1f} ms | 1 (baseline) "
          "| - | - | - |")
    print(f"| GRPOTrainer step, exact(trainer) | {ex * 1e3:.1f} ms | {min(times['exact']) * 1e3:.1f} ms | "
          f"{ex / plain:.3f} | {statistics.median(round_ratios):.3f} | {statistics.median(paired):.3f} | <= 1.03 |")


def print_memory(mem: dict[str, dict[str, float]]) -> None:
    print()
    print("| form | peak RSS, MiB | x | step's own RSS, MiB | x |")
    print("|---|---:|---:|---:|---:|")
    for form, name in MEMORY_FORMS.items():
        base = mem["plain" if form in ("plain", "exact") else "loop, no accumulator"]
        m = mem[form]
        print(f"| {name} | {m['peak']:.0f} | {m['peak'] / base['peak']:.2f} | {m['own']:.0f} | "
              f"{m['own'] / base['own']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each form first in every other (default 4)")
    parser.add_argument("--steps", type=int, default=6,
                        help="optimizer steps per train(), the first a warm-up (default 6)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round of 3 steps: a smoke run")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one memory form, in its own process
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.quick, opts.steps)
        return
    rounds, steps = (1, 3) if opts.quick else (opts.rounds, opts.steps)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    load, start = os.getloadavg(), datetime.now(UTC)
    times: dict[str, list[float]] = {"plain": [], "exact": []}
    round_ratios, paired, same = [], [], [0, 0]
    for r in range(rounds):
        order = ("plain", "exact") if r % 2 == 0 else ("exact", "plain")
        got = round_of(order, steps, opts.quick)
        for form in order:
            times[form].extend(got[form])
        round_ratios.append(statistics.median(got["exact"]) / statistics.median(got["plain"]))
        paired.extend(e / p for e, p in zip(got["exact"], got["plain"], strict=True))  # the same completions
        same = [a + b for a, b in zip(same, got["same"], strict=True)]
        print(f"round {r}: TRL's own {statistics.median(got['plain']) * 1e3:.1f} ms, exact "
              f"{statistics.median(got['exact']) * 1e3:.1f} ms, ratio {round_ratios[-1]:.3f}; the same tokens seen "
              f"after {got['same'][0]} of {got['same'][1]} steps", flush=True)
    middle = os.getloadavg()
    mem = memory(opts.quick, 2 if opts.quick else 3)
    print_times(times, round_ratios, paired)
    print_memory(mem)
    params = sum(p.numel() for p in __import__("transformers").LlamaForCausalLM(model_config(opts.quick)).parameters())
    print()
    print(f"Model: LlamaForCausalLM, {params / 1e6:.2f} M parameters, float32; loss_type dapo, beta 0; "
          f"{PER_DEVICE} completions per microbatch, {WINDOW} microbatches per step, {GENERATIONS} completions per "
          f"prompt of at most {completion_length(opts.quick)} tokens, max_grad_norm 1.0; one process, 1 torch "
          f"thread. {rounds} rounds x {steps - 1} timed steps per form (after 1 warm-up step per train()), in "
          f"lockstep; both forms had seen the same tokens after {same[0]} of {same[1]} steps. "
          f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
          f"{__import__('transformers').__version__}, TRL {__import__('trl').__version__}; "
          f"{start:%Y-%m-%d %H:%M}-{datetime.now(UTC):%H:%M} UTC; load average (1, 5, 15 min) before the run: "
          f"{' '.join(f'{x:.2f}' for x in load)}, after the timed rounds: {' '.join(f'{x:.2f}' for x in middle)}, "
          f"at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")


if __name__ == "__main__":
    main()
