"""Benchmark: a torchft step in which a replica group dies, the survivors' retry against torchft's drop-and-redo.

3 replica groups of 1 rank (gloo processes on loopback), torchft's in-process lighthouse in this process (heartbeat
and join timeouts 1 s, as a loaded test machine needs), 1 torch thread per rank, float32, bench_training.py's MLP
(9.45 M parameters), M = 8 microbatches of 16 samples per group and step. Step 0 runs whole; in step 1 group 2
runs its window and dies at its all-reduce (its process group aborted: its connections close, as a dying process's
do). Timed on each survivor, from the start of step 1's window until a committed step holds that window's samples:

* **retry** (``exact(..., retries=1)``, gradagg's default): ``finish()`` sees the failed all-reduce, starts a new
  quorum at the same step (without the dead group) and sends the saved window again: one window of forward and
  backward;
* **drop and redo** (``retries=0``, torchft's own behaviour): the step is dropped, the loop re-feeds the window's
  microbatches into the next step and runs their forward and backward again: two windows.

Each world is one run of one mode (a death cannot be undone); the modes alternate (retry, drop, drop, retry, ...).
A run's time is the slower survivor's. Both modes pay the same failure detection and new quorum; the difference
is the forward and backward the retry does not redo. Each survivor's peak RSS (the process's high-water mark, model
and optimizer included) shows the memory: the retry keeps no second gradient-sized buffer.

Run: ``flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_torchft_failure.py`` (``--quick``: a small
model, one run of each: a smoke run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

from bench_torchft import QUICK_WIDTHS, Data, make_data, make_model  # noqa: E402
from bench_training import WIDTHS  # noqa: E402

from gradagg.testing import run_local_world  # noqa: E402

GROUPS, DIES = 3, 2


def window(ft: Any, model: torch.nn.Module, data: Data) -> float:
    """One window's forward and backward; its seconds."""
    t0 = time.perf_counter()
    for x, y in ft.microbatches(data):
        with ft.microbatch(weight=y.numel()):
            ((model(x) - y) ** 2).sum().backward()
    return time.perf_counter() - t0


def failure_rank(lighthouse: str, ports: list[int], mode: str, widths: list[int]) -> dict[str, Any]:
    from torchft import Manager, ProcessGroupGloo

    from gradagg.integrations.torchft import exact
    from gradagg.torch import MicrobatchAccumulator

    torch.set_num_threads(1)
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    model = make_model(widths)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    timeout = datetime.timedelta(seconds=10)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=f"g{rank}", store_addr="127.0.0.1", store_port=ports[rank], rank=0, world_size=1,
                      lighthouse_addr=lighthouse, init_sync=False, timeout=timeout)
    ft = exact(manager, MicrobatchAccumulator(model, group=alone), group=f"g{rank}",
               retries=1 if mode == "retry" else 0)
    data = make_data(widths)
    try:
        manager.start_quorum()  # step 0, whole: every group warm
        window(ft, model, data)
        if not ft.finish().committed:
            raise RuntimeError("step 0 was not committed")
        opt.step()
        opt.zero_grad()
        dist.barrier()
        manager.start_quorum()
        t0 = time.perf_counter()
        spent, windows = window(ft, model, data), 1
        if rank == DIES:
            manager.num_participants()  # in step 1's quorum, then gone at its all-reduce
            pg.abort()
            return {}
        report = ft.finish()
        while not report.committed:  # drop and redo: the window's microbatches again, in the next attempt
            opt.zero_grad()
            manager.start_quorum()
            spent, windows = spent + window(ft, model, data), windows + 1
            report = ft.finish()
        elapsed = time.perf_counter() - t0
        opt.step()
        return {"time": elapsed, "window": spent / windows, "windows": windows, "attempts": report.attempts,
                "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "params": sum(p.numel() for p in model.parameters())}
    finally:
        manager.shutdown(wait=False)


def one_run(mode: str, widths: list[int]) -> list[dict[str, Any]]:
    from torchft._torchft import LighthouseServer  # torchft's own tests start it so

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(GROUPS)]
    try:
        out = run_local_world(failure_rank, GROUPS, lighthouse.address(), [s.port for s in stores], mode, widths,
                              timeout_s=600.0, collective_timeout_s=120.0, preload=["torchft"])
    finally:
        lighthouse.shutdown()
    return [r for r in out if r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, one run of each mode: a smoke run")
    parser.add_argument("--runs", type=int, default=4, help="runs of each mode (default 4)")
    args = parser.parse_args(argv)
    widths, runs = (QUICK_WIDTHS, 1) if args.quick else (WIDTHS, args.runs)
    results: dict[str, list[list[dict[str, Any]]]] = {"retry": [], "drop": []}
    for i in range(runs):
        for mode in (("retry", "drop") if i % 2 == 0 else ("drop", "retry")):
            results[mode].append(one_run(mode, widths))
    t = {m: [max(r["time"] for r in run) for run in rs] for m, rs in results.items()}
    w = {m: statistics.median(r["window"] for run in rs for r in run) for m, rs in results.items()}
    windows = {m: sorted({r["windows"] for run in rs for r in run}) for m, rs in results.items()}
    peak = {m: statistics.median(r["peak_mb"] for run in rs for r in run) for m, rs in results.items()}
    params = results["retry"][0][0]["params"]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}; {params / 1e6:.2f} M parameters, {GROUPS} groups, group {DIES} dies, "
          f"{runs} runs of each mode")
    print("| mode | failed step to its commit, median (min), ms | windows of forward and backward | one window, ms "
          "| a survivor's peak RSS, median, MB |")
    print("|---|---|---|---|---|")
    for m, name in (("drop", "torchft's drop and redo (retries=0)"), ("retry", "gradagg's retry (retries=1)")):
        print(f"| {name} | {statistics.median(t[m]) * 1e3:.0f} ({min(t[m]) * 1e3:.0f}) | "
              f"{', '.join(map(str, windows[m]))} | {w[m] * 1e3:.0f} | {peak[m]:.0f} |")
    for m in ("drop", "retry"):
        print(f"{m}, each run, ms: " + ", ".join(f"{x * 1e3:.0f}" for x in t[m]))
    print(f"retry / drop, ratio of medians: {statistics.median(t['retry']) / statistics.median(t['drop']):.3f}; "
          f"saved, median: {(statistics.median(t['drop']) - statistics.median(t['retry'])) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
