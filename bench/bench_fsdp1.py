"""Benchmark of gradagg under FSDP1: peak memory and step time per rank, against FSDP1's own accumulation.

4 gloo ranks on loopback, the transformer of bench/bench_fsdp.py (by default 8 encoder blocks, d = 256), FSDP1
(``FullyShardedDataParallel``, ``FULL_SHARD``, ``use_orig_params=True``) on every block and on the root, M = 4
microbatches per rank. Each form runs in a fresh 4-rank world (RSS peaks are per process), the forms in turn,
``--rounds`` times over:

* ``FSDP1 reduce-scatter every microbatch``: FSDP1's default accumulation, shards only (the baseline): the loss
  divided by the global token count by hand, FSDP1 averaging each reduce over the ranks (even counts only).
* ``FSDP1 no_sync until the last``: FSDP1's low-communication recipe, unsharded gradients kept over the step.
* ``gradagg FSDP1 shards``: ``MicrobatchAccumulator(model)``, the README's loop (a SUM hook, one division).
* ``gradagg FSDP1 shards, counts 1 4 0 3``: uneven counts, padded (4 rounds on every rank).

Target (issue 34): gradagg's form at most 1.05x the baseline's step time and peak memory. Memory as in
bench/bench_fsdp.py (peak RSS with glibc returning freed blocks, and the same less the RSS before the model was
built); the model is built on the meta device and materialised unit by unit by FSDP1 (``param_init_fn``).

Run: ``flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_fsdp1.py`` (``--quick``: a small model, one
round, one timed step: a smoke run, used by the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from bench_fsdp import (
    QUICK,
    Size,
    Transformer,
    batches,
    loss_sum,
    malloc_returns_memory,
    measure,
    peak_rss_mib,
    rss_mib,
    table,
)
from torch import nn

from gradagg.torch import MicrobatchAccumulator

RANKS, M = 4, 4
UNEVEN = [1, 4, 0, 3]
BASELINE = "FSDP1 reduce-scatter every microbatch"
FORMS = (BASELINE, "FSDP1 no_sync until the last", "gradagg FSDP1 shards", "gradagg FSDP1 shards, counts 1 4 0 3")
DEFAULT = Size(layers=8, d=256, vocab=2048, tokens=32, steps=3)


def build(size: Size) -> nn.Module:
    """FSDP1 on every encoder block and the root, materialised unit by unit from the meta device."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with torch.device("meta"):
        model = Transformer(size)
    cpu = torch.device("cpu")
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}), use_orig_params=True,
                   device_id=cpu, param_init_fn=lambda m: m.to_empty(device=cpu, recurse=False))
    g = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in wrapped.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return wrapped


def own_step(model: Any, mine: list[torch.Tensor], no_sync: bool) -> None:
    """FSDP1's own recipe, even counts: loss / global tokens x world (FSDP1 then averages the ranks)."""
    total = len(mine) * (mine[0].shape[1] - 1) * dist.get_world_size()
    for k, tokens in enumerate(mine):
        last = k == len(mine) - 1
        with model.no_sync() if no_sync and not last else contextlib.nullcontext():
            (loss_sum(model, tokens) * (dist.get_world_size() / total)).backward()


def form_world(form: str, size: Size) -> dict[str, Any]:
    """One form on this rank: a warm-up step, then ``size.steps`` timed ones; times and memory."""
    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    malloc_returns_memory()
    base = rss_mib()
    model = build(size)
    counts = UNEVEN if "counts" in form else [M] * dist.get_world_size()
    mine = batches(size, counts[dist.get_rank()])
    acc = MicrobatchAccumulator(model) if form.startswith("gradagg") else None
    times = []
    for step in range(1 + size.steps):
        dist.barrier()
        start = time.perf_counter()
        if acc is None:
            own_step(model, mine, no_sync="no_sync" in form)
        else:
            for tokens in acc.microbatches(mine):
                with acc.microbatch(weight=tokens.shape[1] - 1):
                    loss_sum(model, tokens).backward()
            acc.finish()
        dist.barrier()  # the step ends when the slowest rank's does
        if step:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    padded = acc.state.padded_last if acc is not None else 0
    return {"times": times, "peak": peak_rss_mib(), "base": base, "padded": padded,
            "params": sum(p.numel() for p in model.parameters()) * dist.get_world_size()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small model, one round, one timed step")
    parser.add_argument("--rounds", type=int, default=3, help="worlds per form (each: 1 warm-up and 3 timed steps)")
    args = parser.parse_args(argv)
    size, rounds = (QUICK, 1) if args.quick else (DEFAULT, args.rounds)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())  # others share these cores: say how busy they were
    out = measure(size, rounds, FORMS, form_world)
    print(table(out, BASELINE, "baseline"))
    params = out[BASELINE]["params"]
    print(f"\nModel: {size.layers} encoder blocks, d = {size.d}, vocab {size.vocab}: {params / 1e6:.1f} M parameters, "
          f"float32, FSDP1 FULL_SHARD per block and root; {RANKS} gloo ranks, 1 thread each; M = {M} "
          f"microbatches of {size.tokens} tokens per rank (uneven row: {UNEVEN}). Medians of {rounds * size.steps} "
          f"timed steps ({rounds} worlds per form, forms in turn); RSS peaks: the largest over ranks and worlds. "
          f"Load average before the run: {load}; {os.cpu_count()} CPUs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
