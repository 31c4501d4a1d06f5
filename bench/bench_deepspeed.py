"""Benchmark: a DeepSpeed ZeRO-2 step with ``gradagg.integrations.deepspeed.exact(engine)`` against DeepSpeed's own
gradient accumulation.

2 gloo ranks on loopback, DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``), 1 torch thread per rank, float32
(``--precision bf16``: DeepSpeed's bf16, bf16 parameters and activations, fp32 master weights, the loss in float32),
torch's SGD, bench_training.py's MLP (9.44 M parameters), M = 8 microbatches of 16 samples per rank and step:

* **DeepSpeed's own**: ``gradient_accumulation_steps`` 8, per microbatch ``engine.backward(mean loss)`` and
  ``engine.step()`` (DeepSpeed steps on the 8th); ZeRO-2 reduces every microbatch's gradient into its partition.
* **gradagg**: ``gradient_accumulation_steps`` 1, ``acc = exact(engine)``, per microbatch ``with
  acc.microbatch(weight=elements): engine.backward(summed loss)``, then one ``engine.step()``: the window is one
  ``coalesce_grad_reduction()`` block, so one reduction per step, and every rank holds its full local gradient
  until then.

Equal counts, so both apply the same gradient: the two engines' parameters are compared after the timed steps
(in bf16 they differ by round-off: DeepSpeed sums the microbatches in bf16, gradagg in float32).

Time: both engines in one world, steps interleaved (A B, then B A, ...), each between two barriers (a step ends
when the slower rank's does); medians, ratio of medians, median of the paired ratios. Target (issue 24): <= 1.05.

Memory, two ways (torch has no allocator counters on the CPU, so these are process figures): (a) in that same
world, each step's transient peak: the peak RSS (``VmHWM``) reset just before the step (``5`` written to
``/proc/self/clear_refs``) and read after it, less the RSS before it: paired like the times; (b) a fresh world per
form: the peak RSS over a warm-up and 3 steps, whole and less the RSS with the engine built before them. Every
world has glibc return freed blocks of 64 KiB or more at once (``mallopt``, as bench_fsdp.py), so that RSS follows
the tensors alive. The larger rank's figure counts. Target (issue 24): <= 1.05.

Run: ``flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_deepspeed.py`` (``--quick``: a small model and
2 steps: a smoke run).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

from bench_fsdp import malloc_returns_memory, rss_mib  # noqa: E402
from bench_training import MICROBATCH, WIDTHS, M  # noqa: E402

from gradagg.testing import run_local_world  # noqa: E402

FORMS = ("deepspeed", "gradagg")
QUICK_WIDTHS = [64, 128, 64]
WORLD: dict[str, Any] = {"collective_timeout_s": 120.0, "timeout_s": 900.0, "env": {"DS_ACCELERATOR": "cpu"}}


def peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``) since it started or since :func:`reset_peak`, MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB


def reset_peak() -> None:
    """Set ``VmHWM`` to the RSS now (Linux 4.0+: ``5`` to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def setup_rank() -> None:
    """1 thread, glibc returning freed memory, the variables a launcher sets (DeepSpeed reads them), and DeepSpeed's
    shared-memory op not compiled: it serves only inference, and its JIT build takes minutes here (see
    tests/integrations/workers/deepspeed_zero.py, no_shared_memory_op, for the private name it sets)."""
    torch.set_num_threads(1)
    malloc_returns_memory()
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29999")
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def make_model(widths: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def make_data(widths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return [(torch.randn(MICROBATCH, widths[0], generator=g), torch.randn(MICROBATCH, widths[-1], generator=g))
            for _ in range(M)]


def engine_of(form: str, widths: list[int], precision: str = "float32") -> tuple[Any, Any]:
    """A ZeRO-2 engine for ``form`` (``precision`` "bf16": DeepSpeed's bf16, bf16 parameters and fp32 master
    weights) and, for gradagg, its accumulator."""
    import deepspeed

    from gradagg.integrations.deepspeed import exact

    model = make_model(widths)
    steps = M if form == "deepspeed" else 1
    cfg = {"train_micro_batch_size_per_gpu": MICROBATCH, "gradient_accumulation_steps": steps,
           "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
           "bf16": {"enabled": precision == "bf16"}}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, dist_init_required=False)
    return engine, (exact(engine) if form == "gradagg" else None)


def step(engine: Any, acc: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One optimizer step of M microbatches, DeepSpeed's way (``acc`` None) or gradagg's; in the engine's dtype,
    the loss in float32."""
    dtype = next(engine.module.parameters()).dtype
    if acc is None:
        for x, y in data:
            engine.backward(nn.functional.mse_loss(engine(x.to(dtype)).float(), y))  # DeepSpeed divides by its 8
            engine.step()
        return
    for x, y in data:
        with acc.microbatch(weight=y.numel()):
            engine.backward(nn.functional.mse_loss(engine(x.to(dtype)).float(), y, reduction="sum"))
    engine.step()


def timed(engine: Any, acc: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """One step between barriers: its seconds and its transient peak RSS above the RSS before it (MiB)."""
    dist.barrier()
    before = rss_mib()
    reset_peak()
    start = time.perf_counter()
    step(engine, acc, data)
    dist.barrier()
    return time.perf_counter() - start, peak_rss_mib() - before


def time_world(repeats: int, widths: list[int], precision: str = "float32") -> dict[str, Any]:
    """Both forms in this world, interleaved: 2 warm-up steps each, then ``repeats`` pairs."""
    setup_rank()
    data = make_data(widths)
    engines = {form: engine_of(form, widths, precision) for form in FORMS}
    out: dict[str, Any] = {f"{form} {what}": [] for form in FORMS for what in ("s", "MiB")}
    for i in range(2 + repeats):
        for form in FORMS if i % 2 == 0 else FORMS[::-1]:
            seconds, mib = timed(*engines[form], data)
            if i >= 2:
                out[f"{form} s"].append(seconds)
                out[f"{form} MiB"].append(mib)
    a, b = (list(engines[f][0].module.parameters()) for f in FORMS)
    out["max_param_diff"] = max(float((p - q).detach().float().abs().max()) for p, q in zip(a, b, strict=True))
    out["params"] = sum(p.numel() for p in a)
    return out


def memory_world(form: str, steps: int, widths: list[int], precision: str = "float32") -> dict[str, float]:
    """One form alone in this world: peak RSS over a warm-up and ``steps`` steps, and the RSS with the engine built
    before them (the model, its ZeRO partitions and the optimizer; ``deepspeed.initialize`` also imports modules)."""
    setup_rank()
    engine, acc = engine_of(form, widths, precision)
    data = make_data(widths)
    base = rss_mib()
    for _ in range(1 + steps):
        step(engine, acc, data)
    return {"peak": peak_rss_mib(), "base": base}


def report(t: dict[str, Any], mem: dict[str, list[dict[str, float]]], args: argparse.Namespace, load: str) -> str:
    def ratio(name: str) -> str:
        a, b = t[f"gradagg {name}"], t[f"deepspeed {name}"]
        paired = statistics.median(x / y for x, y in zip(a, b, strict=True) if y > 0)
        return f"{statistics.median(a) / statistics.median(b):.3f} | {paired:.3f}"

    peak = {f: max(r["peak"] for r in mem[f]) for f in FORMS}
    own = {f: max(r["peak"] - r["base"] for r in mem[f]) for f in FORMS}
    rows = [
        "| what | DeepSpeed's own | gradagg | ratio of medians | median of paired ratios | target |",
        "|---|---:|---:|---:|---:|---|",
        f"| step time, median (min), ms | {statistics.median(t['deepspeed s']) * 1e3:.1f} "
        f"({min(t['deepspeed s']) * 1e3:.1f}) | {statistics.median(t['gradagg s']) * 1e3:.1f} "
        f"({min(t['gradagg s']) * 1e3:.1f}) | {ratio('s')} | <= 1.05 |",
        f"| step's transient peak RSS, median, MiB (a) | {statistics.median(t['deepspeed MiB']):.1f} | "
        f"{statistics.median(t['gradagg MiB']):.1f} | {ratio('MiB')} | - |",
        f"| peak RSS of a fresh world, MiB (b) | {peak['deepspeed']:.0f} | {peak['gradagg']:.0f} | "
        f"{peak['gradagg'] / peak['deepspeed']:.3f} | - | <= 1.05 |",
        f"| the same less the RSS of the built engine, MiB (b) | {own['deepspeed']:.0f} | {own['gradagg']:.0f} | "
        f"{own['gradagg'] / own['deepspeed']:.3f} | - | - |",
    ]
    import deepspeed

    return "\n".join(rows) + (
        f"\n\nModel: MLP {args.widths}, {t['params'] / 1e6:.2f} M parameters, {args.precision}, ZeRO-2, 2 gloo "
        "ranks x 1 thread; "
        f"M = {M} microbatches of {MICROBATCH} samples per rank. {args.repeats} interleaved pairs after 2 warm-ups; "
        f"{args.memory_steps} steps after a warm-up in each memory world. The two engines' parameters after the "
        f"timed steps differ by at most {t['max_param_diff']:.1e}. Python {platform.python_version()}, torch "
        f"{torch.__version__}, DeepSpeed {deepspeed.__version__}; {os.cpu_count()} CPUs; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; load average before: {load}, after: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per form, interleaved (default 15)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps per memory world (default 3)")
    parser.add_argument("--quick", action="store_true", help="a small model, 2 pairs, 1 memory step: a smoke run")
    parser.add_argument("--precision", choices=("float32", "bf16"), default="float32",
                        help="the engines' precision: float32 (default), or DeepSpeed's bf16 (fp32 master weights)")
    args = parser.parse_args(argv)
    args.widths = WIDTHS
    if args.quick:
        args.widths, args.repeats, args.memory_steps = QUICK_WIDTHS, 2, 1
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())  # others share these cores: say how busy they were
    t = run_local_world(time_world, 2, args.repeats, args.widths, args.precision, **WORLD)
    merged = {k: [max(a, b) for a, b in zip(t[0][k], t[1][k], strict=True)] if isinstance(t[0][k], list)
              else max(t[0][k], t[1][k]) for k in t[0]}  # the larger rank's figure (times: equal, barriers)
    mem = {form: run_local_world(memory_world, 2, form, args.memory_steps, args.widths, args.precision, **WORLD)
           for form in FORMS}
    print(report(merged, mem, args, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
