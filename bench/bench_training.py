"""Benchmark of gradagg.torch: what exactly-once accumulation and owner-aware reduction cost.

One run measures, side by side (interleaved, medians):

1. one process: a training step's accumulation (zero_grad, M = 8 microbatches forward/backward, grads
   ready) with MicrobatchAccumulator against the hand-written ``(loss / M).backward()`` loop, on an MLP
   of about 10^7 parameters. Target: at most 5% slower (issue 4), at most 3% (issue 24).
2. two gloo processes on loopback: ``finish()`` and ``owner_reduce`` against one plain ``all_reduce`` of
   the same bytes. Target: at most 1.2x. Collectives per call counted (targets: 1, 1, and 1 scalar for
   ``grad_norm``; ownership verification is a separate, once-per-declaration collective).
3. two gloo processes, DDP with its overlap: a whole step (M = 8 microbatches, equal counts) with
   ``MicrobatchAccumulator(ddp)`` and ``acc.microbatches(...)`` (buckets sent during the last backward)
   against plain DDP with ``no_sync()`` on the first 7 microbatches and ``loss / M``. Target: at most 1.05x.
   And against the exact loop written by hand (``no_sync()`` throughout, one all_reduce of the flattened
   gradients, divided by the global count). Target (issue 24): at most 1.03x.

Run: ``flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_training.py [--write PATH]``
(``--quick`` for a smoke run, ``--only single|ranks|ddp`` for one part, ``--allocator keep`` to time the work
without glibc's page faults); bench/RESULTS.md records runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.testing import run_local_world
from gradagg.torch import (
    MicrobatchAccumulator,
    Ownership,
    count_collectives,
    grad_norm,
    owner_reduce,
)

M = 8  # microbatches per step
MICROBATCH = 16  # samples per microbatch
WIDTHS = [1024, 2048, 2048, 1024, 1024]  # Linear layers between these widths: 9.45 M parameters


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(MICROBATCH, WIDTHS[0], generator=g), torch.randn(MICROBATCH, WIDTHS[-1], generator=g))
        for _ in range(M)
    ]


def step_hand(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    model.zero_grad(set_to_none=True)
    for x, y in data:
        (nn.functional.mse_loss(model(x), y) / len(data)).backward()


def step_acc(model: nn.Module, acc: MicrobatchAccumulator, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    model.zero_grad(set_to_none=True)
    for x, y in data:
        with acc.microbatch():
            nn.functional.mse_loss(model(x), y).backward()
    acc.finish()


CPU = "/cpu"  # the process's CPU seconds (all its threads) beside each wall time: other jobs' share of the cores
# lengthens the wall time of whichever side they hit, not its CPU time


def interleaved(fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Run the candidates alternately, the order reversed every other round (A B, B A, ...), so that drift on a
    shared machine hits both alike and neither always runs right after the other (warm caches, a freshly freed
    heap)."""
    times: dict[str, list[float]] = {k + suffix: [] for k in fns for suffix in ("", CPU)}
    for i in range(warmup + repeats):
        for name, fn in list(fns.items())[:: -1 if i % 2 else 1]:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                times[name].append(t1 - t0)
                times[name + CPU].append(c1 - c0)
    return times


def malloc_keeps_memory() -> bool:
    """glibc: serve allocations up to 32 MiB (its largest mmap threshold) from the heap and never trim it.

    By default glibc maps a freed gradient-sized block back to the system, and the next tensor of that size is
    page-faulted in anew: how many faults a step takes depends on the allocator's history (seen from a few
    hundred to 20,000 a step, on either side), which moved these medians by more than the overhead measured.
    With the memory kept, a step after the warm-up faults in no page, and the two sides differ by the work
    they do. Returns whether glibc accepted both settings (False elsewhere: the default allocator is measured).
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters, malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def bench_single(repeats: int) -> dict[str, Any]:
    # One thread: on 2 cores shared with other jobs, a 2-thread op waits for its slower thread whenever
    # a core is taken, and medians were seen to vary 4x between runs; 1 thread varied by a few percent.
    torch.set_num_threads(1)
    model, data = make_model(), make_data()
    acc = MicrobatchAccumulator(model)
    times = interleaved({"hand": lambda: step_hand(model, data), "acc": lambda: step_acc(model, acc, data)}, repeats)
    with count_collectives() as c:
        step_acc(model, acc, data)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "times": times,
        "collectives": c.total,
        "threads": torch.get_num_threads(),
    }


# --- two gloo ranks (this function runs in each rank) -------------------------------------------------


def _balanced_owners(model: nn.Module, world: int) -> dict[str, int]:
    """Greedy: each parameter to the rank owning the fewest elements so far (largest first)."""
    load = [0] * world
    owners: dict[str, int] = {}
    for name, p in sorted(model.named_parameters(), key=lambda kv: -kv[1].numel()):
        r = load.index(min(load))
        owners[name] = r
        load[r] += p.numel()
    return owners


def _synced(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        dist.barrier()  # start together: the time is the collective's, not a peer's lateness
        fn()

    return run


def _fill_grads(model: nn.Module, acc: MicrobatchAccumulator) -> None:
    model.zero_grad(set_to_none=True)
    with acc.microbatch():
        sum(p.sum() for p in model.parameters()).backward()  # type: ignore[union-attr]


def rank_bench(repeats: int, keep: bool = False) -> dict[str, Any]:
    if keep:
        malloc_keeps_memory()
    model = make_model()
    params = dict(model.named_parameters())
    numel = sum(p.numel() for p in params.values())
    acc = MicrobatchAccumulator(model)
    balanced = Ownership.from_tensors(params, owners=_balanced_owners(model, dist.get_world_size()))
    skewed = Ownership.from_tensors(params, owners=0)
    contributions = {n: torch.randn_like(p) for n, p in params.items()}
    balanced.verify()
    skewed.verify()
    _fill_grads(model, acc)
    acc.finish()  # builds the layout (and checks it across ranks once)
    plain_same_as_finish = torch.randn(acc.state.layout().size)
    plain = torch.randn(numel)

    def finish_only() -> None:
        _fill_grads(model, acc)  # outside the timed region below
        dist.barrier()
        t0 = time.perf_counter()
        acc.finish()
        finish_times.append(time.perf_counter() - t0)

    finish_times: list[float] = []
    times = interleaved(
        {
            "plain": _synced(lambda: dist.all_reduce(plain)),
            "plain_finish_bytes": _synced(lambda: dist.all_reduce(plain_same_as_finish)),
            "owner_balanced": _synced(lambda: owner_reduce(contributions, balanced)),
            "owner_skewed": _synced(lambda: owner_reduce(contributions, skewed)),
            "owner_gather": _synced(lambda: owner_reduce(contributions, balanced, collective="all_gather")),
            "finish": finish_only,
            "grad_norm": _synced(lambda: grad_norm(model.parameters())),
        },
        repeats,
    )
    times["finish"] = finish_times[-repeats:]
    counts = {}
    for name, fn in {
        "finish": lambda: acc.finish(),
        "owner_balanced": lambda: owner_reduce(contributions, balanced),
        "owner_skewed": lambda: owner_reduce(contributions, skewed),
        "owner_gather": lambda: owner_reduce(contributions, balanced, collective="all_gather"),
        "grad_norm": lambda: grad_norm(model.parameters()),
    }.items():
        if name == "finish":
            _fill_grads(model, acc)
        with count_collectives() as c:
            fn()
        counts[name] = dict(c.by_op)
    return {"times": times, "counts": counts, "numel": numel}


# --- DDP with its overlap (this function runs in each rank) ----------------------------------------------


def ddp_bench(repeats: int, keep: bool = False) -> dict[str, Any]:
    """A whole step under DDP: plain no_sync + loss / M against the accumulator (look-ahead: overlap kept)."""
    if keep:
        malloc_keeps_memory()
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    data = make_data()
    plain, ours, ours_late = DDP(make_model()), DDP(make_model()), DDP(make_model())
    acc, acc_late = MicrobatchAccumulator(ours), MicrobatchAccumulator(ours_late)

    def step_plain() -> None:
        plain.zero_grad(set_to_none=True)
        for k, (x, y) in enumerate(data):
            sync = k == len(data) - 1  # DDP reduces in the last backward only
            with contextlib.nullcontext() if sync else plain.no_sync():
                (nn.functional.mse_loss(plain(x), y) / len(data)).backward()

    def step_acc(model: nn.Module, a: MicrobatchAccumulator, lookahead: bool) -> None:
        model.zero_grad(set_to_none=True)
        for x, y in a.microbatches(data) if lookahead else data:
            with a.microbatch():
                nn.functional.mse_loss(model(x), y).backward()
        a.finish()

    hand = DDP(make_model())

    def step_hand() -> None:
        """The exact loop by hand: no_sync throughout, unscaled losses, one all_reduce of the flattened gradients,
        divided by the global count of microbatches (equal counts: world x M)."""
        hand.zero_grad(set_to_none=True)
        with hand.no_sync():
            for x, y in data:
                nn.functional.mse_loss(hand(x), y).backward()
        grads = [p.grad for p in hand.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size() * len(data)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    times = interleaved(
        {
            "ddp": _synced(step_plain),
            "acc": _synced(lambda: step_acc(ours, acc, True)),
            "acc_no_lookahead": _synced(lambda: step_acc(ours_late, acc_late, False)),
            "hand": _synced(step_hand),
        },
        repeats,
    )
    diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(plain.parameters(), ours.parameters()))
    diff_hand = max(float((a.grad - b.grad).abs().max()) for a, b in zip(hand.parameters(), ours.parameters()))
    with count_collectives() as c:
        step_acc(ours, acc, True)
    return {
        "times": times,
        "max_grad_diff": diff,
        "max_grad_diff_hand": diff_hand,
        "collectives": dict(c.by_op),
        "buckets": len(acc.state.layout().buckets),
    }


def ddp_table(res: dict[str, Any]) -> str:
    t = res["times"]

    def ms(ts: list[float]) -> str:
        return f"{statistics.median(ts) * 1e3:.1f} ms (min {min(ts) * 1e3:.1f})"

    coll = ", ".join(f"{n} {op}" for op, n in res["collectives"].items())
    rows = [
        ("DDP step, M = 8: no_sync x 7, loss / M", ms(t["ddp"]), "1 (baseline)", "DDP's buckets", "-"),
        (
            "DDP step, M = 8: MicrobatchAccumulator, microbatches()",
            ms(t["acc"]),
            _ratios(t, "acc", "ddp"),
            coll,
            "<= 1.05",
        ),
        (
            "DDP step, M = 8: MicrobatchAccumulator, no look-ahead",
            ms(t["acc_no_lookahead"]),
            _ratios(t, "acc_no_lookahead", "ddp"),
            coll,
            "-",
        ),
        ("DDP step, M = 8: by hand, no_sync x 8, one all_reduce, / (world x M)", ms(t["hand"]),
         _ratios(t, "hand", "ddp"), "1 all_reduce", "-"),
        ("(MicrobatchAccumulator, microbatches(), against the row above)", "", _ratios(t, "acc", "hand"), "",
         "<= 1.03"),
    ]
    head = (
        "| what | median | ratio of medians (median of paired ratios) | collectives per step | target |\n"
        "|---|---:|---:|---|---|"
    )
    return (
        head
        + "\n"
        + "\n".join("| " + " | ".join(r) + " |" for r in rows)
        + f"\n\nGradients of plain DDP and the accumulator differ by at most {res['max_grad_diff']:.1e}, of the "
        f"loop by hand and the accumulator by {res['max_grad_diff_hand']:.1e} (float32 round-off); "
        f"the accumulator sent {res['buckets']} buckets."
    )


# --- report ----------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores visible; Python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.system()} {platform.release()}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )


def _ratios(times: dict[str, list[float]], name: str, base: str) -> str:
    """Ratio of medians, and the median of the per-repeat ratios (each pair measured back to back)."""
    a, b = times[name], times[base]
    paired = statistics.median(x / y for x, y in zip(a, b))
    return f"{statistics.median(a) / statistics.median(b):.3f} ({paired:.3f})"


def _ms(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.1f} ms (min {min(ts) * 1e3:.1f})"


def single_rows(single: dict[str, Any]) -> list[tuple[str, ...]]:
    st = single["times"]
    return [
        ("step, M = 8: hand-written (loss / M).backward()", _ms(st["hand"]), "1 (baseline)", "0 (one process)", "-"),
        (
            "step, M = 8: MicrobatchAccumulator",
            _ms(st["acc"]),
            _ratios(st, "acc", "hand"),
            "0 (one process)",
            "<= 1.05 (issue 4), <= 1.03 (issue 24)",
        ),
        (
            "(the same two, CPU time of the process: hand-written, MicrobatchAccumulator)",
            f"{_ms(st['hand' + CPU])}; {_ms(st['acc' + CPU])}",
            _ratios(st, "acc" + CPU, "hand" + CPU),
            "",
            "",
        ),
    ]


def table(single: dict[str, Any] | None, ranks: dict[str, Any] | None) -> str:
    head = (
        "| what | median | ratio of medians (median of paired ratios) | collectives per call | target |\n"
        "|---|---:|---:|---|---|"
    )
    rows = (single_rows(single) if single else []) + (rank_rows(ranks) if ranks else [])
    return head + "\n" + "\n".join("| " + " | ".join(r) + " |" for r in rows)


def rank_rows(ranks: dict[str, Any]) -> list[tuple[str, ...]]:
    rt, counts = ranks["times"], ranks["counts"]
    mb = ranks["numel"] * 4 / 1e6
    ms = _ms

    def c(name: str) -> str:
        return ", ".join(f"{n} {op}" for op, n in counts[name].items())

    return [
        (f"2 gloo ranks: plain all_reduce, {mb:.1f} MB", ms(rt["plain"]), "1 (baseline)", "1 all_reduce", "-"),
        (
            "finish() (grads + M + participation + status)",
            ms(rt["finish"]),
            _ratios(rt, "finish", "plain"),
            c("finish"),
            "<= 1.2, 1",
        ),
        (
            "(plain all_reduce of finish()'s exact buffer)",
            ms(rt["plain_finish_bytes"]),
            _ratios(rt, "plain_finish_bytes", "plain"),
            "1 all_reduce",
            "-",
        ),
        (
            "owner_reduce, owners balanced, auto",
            ms(rt["owner_balanced"]),
            _ratios(rt, "owner_balanced", "plain"),
            c("owner_balanced"),
            "<= 1.2, 1",
        ),
        (
            "owner_reduce, rank 0 owns all, auto",
            ms(rt["owner_skewed"]),
            _ratios(rt, "owner_skewed", "plain"),
            c("owner_skewed"),
            "<= 1.2, 1",
        ),
        (
            "owner_reduce, owners balanced, forced all_gather",
            ms(rt["owner_gather"]),
            _ratios(rt, "owner_gather", "plain"),
            c("owner_gather"),
            "(why auto avoids it on gloo)",
        ),
        (
            "grad_norm (replicated: rank 0 counts)",
            ms(rt["grad_norm"]),
            _ratios(rt, "grad_norm", "plain"),
            c("grad_norm"),
            "1 scalar",
        ),
        (
            "(owner_reduce balanced, rank 0 owns all: rank 0's CPU time against the plain all_reduce's)",
            f"{ms(rt['plain' + CPU])}; {ms(rt['owner_balanced' + CPU])}; {ms(rt['owner_skewed' + CPU])}",
            f"{_ratios(rt, 'owner_balanced' + CPU, 'plain' + CPU)}; {_ratios(rt, 'owner_skewed' + CPU, 'plain' + CPU)}",
            "",
            "",
        ),
    ]


NOTES = """
How to read it:
- The one-process rows compare whole accumulation steps (zero_grad, 8 forward/backward, gradients ready).
  The accumulator adds a post-accumulate-grad hook call per parameter and microbatch, copies each
  parameter's first gradient of the window into its buffer (autograd hands the loop by hand its first
  gradient as .grad without a copy) and divides once at finish(); the hand-written loop scales each loss
  instead. The CPU-time row is the process's own CPU seconds: other jobs on the cores lengthen the wall
  time of whichever side they hit.
- finish() is one all_reduce per 25 MB bucket of a buffer the gradients were added into by the hooks
  (no copy out: .grad are views) plus one division pass by the counted divisor.
- The DDP rows: the accumulator keeps DDP in no_sync() and sends its own buckets (one collective each,
  the same on every rank whatever the counts); with microbatches() the complete buckets leave during the
  last backward, as DDP's do.
- owner_reduce copies the owned shards into its flat buffer and writes zeros over the others (one pass),
  then one all_reduce; the results are views of the buffer (no copy out).
- On gloo, "auto" picks the all_reduce even when the all_gather would move fewer bytes: gloo's
  all_gather is several times slower here (the forced all_gather row).
- Other jobs share these 2 cores. The row that runs the same all_reduce as the baseline on finish()'s
  exact buffer shows how far two identical operations drift apart in one run.
"""


PARTS = ("single", "ranks", "ddp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="training steps per variant (one process)")
    parser.add_argument("--repeats-ranks", type=int, default=41, help="collective calls per variant (2 ranks)")
    parser.add_argument("--repeats-ddp", type=int, default=15, help="DDP training steps per variant (2 ranks)")
    parser.add_argument(
        "--only", choices=PARTS, action="append", help="run only this part (repeatable): the one-process step "
        "(single), the collectives on 2 ranks (ranks), the DDP steps (ddp); default: all three"
    )
    parser.add_argument(
        "--allocator", choices=("default", "keep"), default="default", help="keep: glibc keeps freed memory "
        "(mallopt, in every process), so no step page-faults its tensors in anew; default: as a user runs"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 repeats of everything")
    parser.add_argument("--write", metavar="PATH", help="also write the table and the machine to this Markdown file")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = args.repeats_ranks = args.repeats_ddp = 2
    parts = set(args.only or PARTS)
    keep = args.allocator == "keep" and malloc_keeps_memory()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())  # others share these cores: say how busy they were
    single = bench_single(args.repeats) if "single" in parts else None
    world = {"collective_timeout_s": 60.0, "timeout_s": 1200.0, "preload": ["torch._dynamo"]}
    ranks = run_local_world(rank_bench, 2, args.repeats_ranks, keep, **world)[0] if "ranks" in parts else None
    ddp = run_local_world(ddp_bench, 2, args.repeats_ddp, keep, **world)[0] if "ddp" in parts else None
    after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = table(single, ranks) + "\n\n" if single or ranks else ""
    text += f"{ddp_table(ddp)}\n\n" if ddp else ""
    repeats = [f"{n} ({what})" for n, what, part in [
        (args.repeats, "one process", "single"), (args.repeats_ranks, "2 ranks", "ranks"),
        (args.repeats_ddp, "DDP steps", "ddp")] if part in parts]
    text += (
        f"Model: MLP {WIDTHS}, {sum(p.numel() for p in make_model().parameters()) / 1e6:.2f} M parameters, float32; "
        f"M = {M} microbatches of {MICROBATCH} samples; the one-process rows use 1 thread, each of the 2 gloo "
        "ranks 1 thread.\n"
        f"Medians of {', '.join(repeats)} interleaved repeats after 2 warm-ups, min in brackets; the baseline and "
        "the candidates run back to back in each repeat, in reversed order every other repeat. "
        f"Allocator: {'glibc keeping freed memory (--allocator keep)' if keep else 'default'}. "
        f"Machine: {machine()}; load average before the run: {load}, after it: {after}.\n"
    )
    text += NOTES
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write("# gradagg.torch benchmark (bench/bench_training.py)\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
