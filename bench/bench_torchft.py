"""Benchmark: a committed torchft step with ``gradagg.integrations.torchft.exact`` against torchft's own DDP step.

2 replica groups of 1 rank (gloo processes on loopback), torchft's in-process lighthouse in this process, 1 torch
thread per rank, float32, torch's SGD, bench_training.py's MLP (9.45 M parameters), M = 8 microbatches of 16
samples per group and step, equal counts (so both apply the same gradient):

* **torchft's own**: ``torchft.ddp.DistributedDataParallel(manager, model)`` (its comm hook sends each gradient
  bucket through ``manager.allreduce``, AVG), ``no_sync()`` for the first 7 microbatches, the mean loss / M, then
  ``torchft.optim.OptimizerWrapper.step()`` (``should_commit()``, then the step).
* **gradagg**: ``MicrobatchAccumulator`` over the group (one rank: no in-group communication), ``exact(manager,
  acc)``, per microbatch ``with ft.microbatch(weight=elements): summed_loss.backward()``, ``ft.finish()`` (the SUM
  and the counts through ``manager.allreduce``, ``should_commit()``), then the plain optimizer's step.

Both forms run in one world with one manager per rank, steps interleaved (A B, then B A, ...), each after a barrier
(``start_quorum()`` is inside the timed step: each form's loop calls it); medians, ratio of medians, median of
the paired ratios. The parameters of the two models are compared after the timed steps. Target (issue 32): <= 1.05.

Run: ``flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_torchft.py`` (``--quick``: a small model and 2
steps: a smoke run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

from bench_training import MICROBATCH, WIDTHS, M  # noqa: E402

from gradagg.testing import run_local_world  # noqa: E402

QUICK_WIDTHS = [64, 128, 64]


def make_model(widths: list[int]) -> nn.Module:
    torch.manual_seed(0)  # both forms, both groups: the same start (torchft's init_sync=False)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def make_data(widths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    return [(torch.randn(MICROBATCH, widths[0], generator=gen), torch.randn(MICROBATCH, widths[-1], generator=gen))
            for _ in range(M)]


def torchft_step(manager: Any, ddp: Any, opt: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    opt.zero_grad()  # torchft's OptimizerWrapper: start_quorum(), then the inner zero_grad
    for i, (x, y) in enumerate(data):
        if i < len(data) - 1:
            with ddp.no_sync():
                (((ddp(x) - y) ** 2).mean() / len(data)).backward()
        else:
            (((ddp(x) - y) ** 2).mean() / len(data)).backward()
    opt.step()  # should_commit(), then the step


Data = list[tuple[torch.Tensor, torch.Tensor]]


def gradagg_step(manager: Any, model: nn.Module, ft: Any, opt: Any, data: Data) -> None:
    manager.start_quorum()
    for x, y in ft.microbatches(data):
        with ft.microbatch(weight=y.numel()):
            ((model(x) - y) ** 2).sum().backward()
    if not ft.finish().committed:
        raise RuntimeError("a benchmark step was not committed")
    opt.step()
    opt.zero_grad()


def bench_rank(lighthouse: str, ports: list[int], repeats: int, widths: list[int]) -> dict[str, Any]:
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from gradagg.integrations.torchft import exact
    from gradagg.torch import MicrobatchAccumulator

    torch.set_num_threads(1)
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    a, b = make_model(widths), make_model(widths)
    timeout = datetime.timedelta(seconds=60)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2, load_state_dict=None,
                      state_dict=None, replica_id=f"g{rank}", store_addr="127.0.0.1", store_port=ports[rank], rank=0,
                      world_size=1, lighthouse_addr=lighthouse, init_sync=False, timeout=timeout)
    ddp = DistributedDataParallel(manager, a)
    opt_a = OptimizerWrapper(manager, torch.optim.SGD(a.parameters(), lr=1e-3))
    opt_b = torch.optim.SGD(b.parameters(), lr=1e-3)
    ft = exact(manager, MicrobatchAccumulator(b, group=alone), group=f"g{rank}")
    data = make_data(widths)
    forms = {"torchft": lambda: torchft_step(manager, ddp, opt_a, data),
             "gradagg": lambda: gradagg_step(manager, b, ft, opt_b, data)}
    times: dict[str, list[float]] = {k: [] for k in forms}
    for k in forms:  # warm-up, untimed
        forms[k]()
    for i in range(repeats):
        for k in (list(forms) if i % 2 == 0 else list(reversed(forms))):
            dist.barrier()
            t0 = time.perf_counter()
            forms[k]()
            times[k].append(time.perf_counter() - t0)
    with torch.no_grad():
        diff = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    manager.shutdown(wait=False)
    return {"times": times, "param_diff": diff, "params": sum(p.numel() for p in a.parameters())}


def main(argv: list[str] | None = None) -> int:
    from torchft._torchft import LighthouseServer  # torchft's own tests start it so

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and 2 steps: a smoke run")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    widths, repeats = (QUICK_WIDTHS, 2) if args.quick else (WIDTHS, args.repeats)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    try:
        out = run_local_world(bench_rank, 2, lighthouse.address(), [s.port for s in stores], repeats, widths,
                              timeout_s=900.0, collective_timeout_s=120.0, preload=["torchft"])
    finally:
        lighthouse.shutdown()
    # a step ends when the slower group's does
    t = {k: [max(r["times"][k][i] for r in out) for i in range(repeats)] for k in ("torchft", "gradagg")}
    paired = statistics.median(g / f for g, f in zip(t["gradagg"], t["torchft"], strict=True))
    ratio = statistics.median(t["gradagg"]) / statistics.median(t["torchft"])
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}; {out[0]['params'] / 1e6:.2f} M parameters, M = {M}, {repeats} steps each")
    print("| what | torchft's own DDP | gradagg | ratio of medians | median of paired ratios | target |")
    print("|---|---|---|---|---|---|")
    print(f"| committed step, median (min), ms | {statistics.median(t['torchft']) * 1e3:.1f} "
          f"({min(t['torchft']) * 1e3:.1f}) | {statistics.median(t['gradagg']) * 1e3:.1f} "
          f"({min(t['gradagg']) * 1e3:.1f}) | {ratio:.3f} | {paired:.3f} | <= 1.05 |")
    print(f"largest parameter difference after the steps: {max(r['param_diff'] for r in out):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
