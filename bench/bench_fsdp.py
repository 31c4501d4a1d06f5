"""Benchmark of gradagg under FSDP2: peak memory and step time per rank, against FSDP2's own two recipes.

4 gloo ranks on loopback, a transformer of about 52 M parameters (16 encoder blocks, d = 512), ``fully_shard``
on every block and on the root, M = 4 microbatches per rank. Each form runs in a fresh 4-rank world (RSS peaks
are per process, so a world measures one form), the forms in turn, twice over (``--rounds``):

* ``FSDP2 sync off until the last``: ``set_requires_gradient_sync(False)`` for microbatches 1..M-1, True on
  the last: FSDP keeps the whole model's unsharded gradients over the step (its low-communication recipe).
* ``FSDP2 reduce-scatter every microbatch``: FSDP's default, shards only (the memory baseline of the targets).
* ``gradagg shards (default)``: ``MicrobatchAccumulator(model)``, the loop of the README.
* ``gradagg window``: ``fsdp="window"`` (unsharded parameters and one unsharded gradient buffer).
* the two gradagg forms with uneven counts (1, 4, 0, 3): the shards form pads (4 rounds on every rank).

FSDP's own recipes divide by hand (even counts only); the loss is the same sum in every form, so the work
per microbatch is the same. Targets (issue 15): gradagg's default form at most 1.15x the shards-only recipe's
peak memory and at most 1.10x its step time.

Memory: peak RSS (``ru_maxrss``) of each rank's process, and the same less its RSS before the model was built
(the interpreter and torch): the step's own memory. glibc is told to return freed blocks of 64 KiB or more at
once (``mallopt``), so that the peak is that of the tensors alive together, not of the allocator's history. The
model is built on the meta device and materialised sharded, so no rank ever holds it whole outside the step.
torch has no allocator counters on the CPU; bench/nccl_check.py measures ``torch.cuda.max_memory_allocated`` for
the same forms on a GPU.

Run: ``flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_fsdp.py`` (``--quick``: a small model, one
round, one timed step: a smoke run, used by the tests).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.testing import run_local_world
from gradagg.torch import MicrobatchAccumulator

RANKS, M = 4, 4
UNEVEN = [1, 4, 0, 3]
FORMS = (
    "FSDP2 sync off until the last",
    "FSDP2 reduce-scatter every microbatch",
    "gradagg shards (default)",
    "gradagg window",
    "gradagg shards, counts 1 4 0 3",
    "gradagg window, counts 1 4 0 3",
)
BASELINE = "FSDP2 reduce-scatter every microbatch"


@dataclass(frozen=True)
class Size:
    """The model and the microbatches."""

    layers: int = 16
    d: int = 512
    vocab: int = 2048
    tokens: int = 32  # per microbatch (one sequence)
    steps: int = 3  # timed steps per world, after one warm-up


QUICK = Size(layers=2, d=64, vocab=128, tokens=8, steps=1)


class Transformer(nn.Module):
    """Embedding, ``layers`` encoder blocks, a linear head: the shape FSDP2 is applied to per block."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(size.d, 8, 4 * size.d, dropout=0.0, batch_first=True) for _ in range(size.layers)
        )
        self.head = nn.Linear(size.d, size.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def rss_mib() -> float:
    """This process's RSS now (from /proc), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def malloc_returns_memory() -> None:
    """glibc: serve every allocation of 64 KiB or more by its own mmap, returned to the system when freed.

    Otherwise freed blocks stay in malloc's arenas (one per thread: gloo's and autograd's threads each hold
    their own), and the RSS peak measures the history of the allocator rather than the tensors alive at once.
    Set at the worker's start, before any tensor of the step (mallopt applies to later allocations).
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # mallopt parameters, malloc.h
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 64 * 1024)
    libc.mallopt(m_arena_max, 1)


def build(size: Size) -> nn.Module:
    """The model, sharded: built on the meta device, fully_shard per block and root, materialised as shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(size)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()  # type: ignore[operator]
            local.copy_(torch.randn(local.shape, generator=g) * 0.02)
    return model


def batches(size: Size, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return [torch.randint(0, size.vocab, (1, size.tokens), generator=g) for _ in range(n)]


def loss_sum(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the tokens (the sum a weighted microbatch back-propagates)."""
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")


def fsdp_step(model: Any, mine: list[torch.Tensor], sync_off: bool) -> None:
    """FSDP2's own recipe, even counts: loss / global tokens (FSDP then averages the ranks)."""
    total = len(mine) * (mine[0].shape[1] - 1) * dist.get_world_size()
    for k, tokens in enumerate(mine):
        if sync_off:
            model.set_requires_gradient_sync(k == len(mine) - 1)
        (loss_sum(model, tokens) * (dist.get_world_size() / total)).backward()


def gradagg_step(model: nn.Module, acc: MicrobatchAccumulator, mine: list[torch.Tensor]) -> None:
    for tokens in acc.microbatches(mine):
        with acc.microbatch(weight=tokens.shape[1] - 1):
            loss_sum(model, tokens).backward()
    acc.finish()


def form_world(form: str, size: Size) -> dict[str, Any]:
    """One form on this rank: a warm-up step, then ``size.steps`` timed ones; times and memory."""
    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    malloc_returns_memory()
    # FSDP warns that the encoder's output is a view (no in-place op follows here): once per forward, noise
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    base = rss_mib()
    model = build(size)
    counts = UNEVEN if "counts" in form else [M] * dist.get_world_size()
    mine = batches(size, counts[dist.get_rank()])
    acc = None
    if form.startswith("gradagg"):
        acc = MicrobatchAccumulator(model, fsdp="window" if "window" in form else "shards")
    times = []
    for step in range(1 + size.steps):
        dist.barrier()
        start = time.perf_counter()
        if acc is None:
            fsdp_step(model, mine, sync_off="sync off" in form)
        else:
            gradagg_step(model, acc, mine)
        dist.barrier()  # the step ends when the slowest rank's does
        if step:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    padded = acc.state.padded_last if acc is not None else 0
    return {"times": times, "peak": peak_rss_mib(), "base": base, "params": params, "padded": padded}


def measure(size: Size, rounds: int, forms: tuple[str, ...] = FORMS, worker: Any = None) -> dict[str, dict[str, Any]]:
    """Each form in a fresh world of ``RANKS`` ranks, the forms in turn, ``rounds`` times over (``worker``: the
    rank's function, ``form_world`` by default; bench/bench_fsdp1.py passes its own)."""
    world = {"collective_timeout_s": 300.0, "timeout_s": 3600.0}
    out: dict[str, dict[str, Any]] = {f: {"times": [], "peak": [], "own": [], "padded": []} for f in forms}
    for _ in range(rounds):
        for form in forms:
            ranks = run_local_world(worker or form_world, RANKS, form, size, **world)
            o = out[form]
            o["times"] += ranks[0]["times"]  # after the closing barrier: the same step time on every rank
            o["peak"].append(max(r["peak"] for r in ranks))
            o["own"].append(max(r["peak"] - r["base"] for r in ranks))
            o["padded"] = [r["padded"] for r in ranks]
            o["params"] = ranks[0]["params"]
    return out


def table(out: dict[str, dict[str, Any]], baseline: str = BASELINE, name: str = "shards-only") -> str:
    """The forms' medians and ratios against ``baseline`` (its column headed ``x {name}``)."""
    base = out[baseline]
    t0, own0, peak0 = statistics.median(base["times"]), max(base["own"]), max(base["peak"])
    rows = [
        f"| form | step time, s (median) | x {name} | peak RSS, MiB | x | step's own RSS, MiB | x "
        "| padding rounds per rank |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for form in out:
        o = out[form]
        t, own, peak = statistics.median(o["times"]), max(o["own"]), max(o["peak"])
        pads = " ".join(str(p) for p in o["padded"]) if form.startswith("gradagg") and "window" not in form else "-"
        rows.append(
            f"| {form} | {t:.3f} | {t / t0:.2f} | {peak:.0f} | {peak / peak0:.2f} | {own:.0f} | {own / own0:.2f} "
            f"| {pads} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small model, one round, one timed step")
    parser.add_argument("--rounds", type=int, default=2, help="worlds per form (each: 1 warm-up and 3 timed steps)")
    parser.add_argument("--forms", type=lambda v: tuple(int(k) for k in v.split(",")), default=None,
                        help="only these forms, by their 0-based place in FORMS, e.g. 4 (the baseline always runs)")
    args = parser.parse_args(argv)
    forms = FORMS if args.forms is None else tuple(f for k, f in enumerate(FORMS) if k in args.forms or f == BASELINE)
    size, rounds = (QUICK, 1) if args.quick else (Size(), args.rounds)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())  # others share these cores: say how busy they were
    out = measure(size, rounds, forms)
    params = out[BASELINE]["params"]
    print(table(out))
    print(
        f"\nModel: {size.layers} encoder blocks, d = {size.d}, vocab {size.vocab}: {params / 1e6:.1f} M parameters, "
        f"float32, fully_shard per block and root; {RANKS} gloo ranks, 1 thread each; M = {M} microbatches of "
        f"{size.tokens} tokens per rank (uneven rows: {UNEVEN}). Medians of {rounds * size.steps} timed steps "
        f"({rounds} worlds per form, forms in turn); RSS peaks: the largest over ranks and worlds. Load average "
        f"before the run: {load}; {os.cpu_count()} CPUs."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
