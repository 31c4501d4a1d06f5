"""Memory and time of loss terms counted as the window runs (issue 23 item 2): 1 to 4 terms, one process.

A float32 MLP (``--width``, 4 layers; 16.8 M parameters at the default width 2048, a 64 MiB flat buffer), M = 4
microbatches per window, every term a function of the same forward (so each term's backward runs with
``retain_graph=True`` but the last), the last term's count given by ``acc.count`` after the last microbatch.
Each configuration runs in a fresh process: ``terms=`` with 1, 2, 3, 4 names, and the baseline, the same single
loss with ``microbatch()`` and one backward. Reported per configuration:

* the extra buffers the accumulator holds in the window (read from the window's state: the exact bytes), and
  that figure over the flat buffer's size: (terms - 1) is the claim;
* the process's peak RSS (``ru_maxrss``) less its RSS before the model was built, with glibc told to return freed
  blocks of 64 KiB or more at once (``mallopt``), so that the peak is that of the tensors alive together;
* the median window time (forwards, every term's backward, ``finish()``) over ``--windows`` windows after one
  untimed one: each term is its own backward, so the time grows with the terms.

Run: ``python bench/bench_terms.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

TERM_NAMES = ("policy", "kl", "nll", "value")


def worker(terms: int, width: int, windows: int) -> dict[str, Any]:
    """One configuration: ``terms`` = 0 is the baseline (one loss, one backward per microbatch)."""
    from bench_fsdp import malloc_returns_memory, rss_mib  # bench/, beside this script (sys.path[0])

    malloc_returns_memory()
    import torch

    from gradagg.torch import MicrobatchAccumulator

    torch.set_num_threads(1)
    before = rss_mib()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    names = TERM_NAMES[:terms]
    acc = MicrobatchAccumulator(model, terms=names or None)
    xs = [torch.randn(8, width) for _ in range(4)]
    times, extra = [], 0
    for k in range(windows + 1):
        start = time.perf_counter()
        for x in xs:
            with acc.microbatch() as mb:
                out = model(x)
                if not names:
                    (out**2).sum().backward()
                    continue
                for j, name in enumerate(names):
                    loss = (out ** (j + 2)).abs().sum()  # each term its own function of the shared forward
                    count = None if name == names[-1] and terms > 1 else 8
                    mb.backward(name, loss, count=count, retain_graph=j < len(names) - 1)
                sums = acc.state.window.term_sums
                extra = max(extra, sum(b.numel() * b.element_size() for b in sums.bufs.values()) if sums else 0)
        if names and terms > 1:
            acc.count(names[-1], 32)  # the last term's count, known only after the last microbatch
        acc.finish()
        for p in model.parameters():
            p.grad = None
        if k:
            times.append(time.perf_counter() - start)
    flat = acc.state.layout().size * torch.empty(0, dtype=acc.state.layout().dtype).element_size()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"terms": terms, "params": sum(p.numel() for p in model.parameters()), "flat_mib": flat / 2**20,
            "extra_mib": extra / 2**20, "extra_over_flat": extra / flat, "peak_less_start_mib": peak - before,
            "window_ms": 1e3 * statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.width, args.windows)))
        return
    rows = []
    for terms in (0, 1, 2, 3, 4):
        cmd = [sys.executable, __file__, "--worker", str(terms), "--width", str(args.width),
               "--windows", str(args.windows)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    base = rows[0]
    print(f"{rows[0]['params'] / 1e6:.1f} M float32 parameters, flat buffer {base['flat_mib']:.1f} MiB, M = 4")
    print("| configuration | extra buffers held | / flat buffer | peak RSS less start | vs baseline | window |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        name = "one loss, microbatch() (baseline)" if r["terms"] == 0 else f"terms=, {r['terms']} term(s)"
        print(f"| {name} | {r['extra_mib']:.1f} MiB | {r['extra_over_flat']:.2f} | {r['peak_less_start_mib']:.1f} MiB "
              f"| {r['peak_less_start_mib'] - base['peak_less_start_mib']:+.1f} MiB | {r['window_ms']:.0f} ms |")


if __name__ == "__main__":
    main()
