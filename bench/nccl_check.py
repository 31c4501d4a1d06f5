"""The training checks on CUDA and NCCL: plain, DDP, FSDP2, FSDP1 and HSDP accumulation against the full batch.

Run: ``.venv/bin/python bench/nccl_check.py`` on a machine with CUDA (``--gloo``: the same checks on 4
CPU gloo ranks, to try the script without a GPU). One rank per GPU, up to 4:
with 2 or more GPUs the ranks run uneven microbatch counts (one rank none) with token weights, under a
plain module, DDP and FSDP2 (the default shards form, gradagg padding the short ranks; the window form; the
every-microbatch name with padding by hand; the window form attached to an optimizer in a plain loop, the clip
finishing it), and FSDP1 (``FULL_SHARD``, nested units, gradagg padding); with 4, HSDP on a (2, 2) mesh as well.
With one GPU, a one-rank NCCL world runs the same code paths (buffers and DTensors on the device, no
cross-rank traffic). Each check compares with one forward/backward of the whole batch in float64 on the
CPU; the tolerance is 1e-10 (float64 sums in another order, on another device's kernels). Exit status: 0
when every check passes or when there is no CUDA device (the reason is printed), 1 otherwise.

``--memory`` (with 2 or more GPUs, or ``--gloo``) then runs bench/bench_fsdp.py's cases on the device: FSDP2's
two recipes, gradagg's shards and window forms, even and uneven (1, 4, 0, 3) counts, and prints each form's
``torch.cuda.max_memory_allocated`` (the step's peak, per rank) and median step time, with ratios to the
shards-only recipe (targets: 1.15x memory, 1.10x time). ``--quick`` shrinks that model for a smoke run.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.testing import run_local_world
from gradagg.torch import MicrobatchAccumulator

TOL = 1e-10
COUNTS = [0, 3, 2, 4]  # microbatches of rank r (the first W); rank 0 runs none


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 1)).double()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n):
        x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(6, 1, generator=g, dtype=torch.float64)
        out.append((x, y, torch.arange(6) < 1 + k % 6))
    return out


def loss_sum(model: nn.Module, b: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    x, y, valid = (t.to(device) for t in b)
    return ((model(x) - y)[valid] ** 2).sum()


def truth(data: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    model = make_model()
    x, y, valid = (torch.cat([b[i] for b in data]) for i in range(3))
    (((model(x) - y)[valid] ** 2).sum() / int(valid.sum())).backward()
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


def _run(model: nn.Module, acc: MicrobatchAccumulator, mine: list[Any], device: torch.device, pad: int = 0) -> None:
    """Weighted microbatches, then ``pad`` weight-0 ones (a filler batch times 0) for the every-microbatch form."""
    items = [(b, True) for b in mine] + [(batches(1)[0], False)] * pad
    for b, real in acc.microbatches(items):
        with acc.microbatch(weight=int(b[2].sum()) if real else 0):
            (loss_sum(model, b, device) * (1.0 if real else 0.0)).backward()
    acc.finish()


def _attached(model: nn.Module, mine: list[Any], device: torch.device) -> None:
    """A framework's loop: ``attach(optimizer)``, a plain ``for`` over this rank's microbatches (none on rank 0),
    no ``finish()``: the clip finishes the window (rank 0 joining FSDP2's opening all-gathers there)."""
    acc = MicrobatchAccumulator(model, fsdp="window")
    acc.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    for b in mine:
        with acc.microbatch(weight=int(b[2].sum())):
            loss_sum(model, b, device).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # given the unsharded tensors on ranks that ran one


def _fsdp1(device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(make_model().to(device), device_id=device, use_orig_params=True,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def _fsdp1_error(model: nn.Module, want: list[torch.Tensor]) -> float:
    """The gradient FSDP1's shards hold, read whole as an SGD step of rate 1 (``before - after``, exact in float64)
    between two ``summon_full_params`` (with ``with_grads=True`` FSDP1's own gradient gather aborts gloo on this
    model on 4 ranks, with or without gradagg: seen, not investigated further)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def full() -> list[torch.Tensor]:
        with FSDP.summon_full_params(model):
            return [p.detach().cpu().clone() for p in model.parameters()]

    before = full()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return max(float((b - a - w).abs().max()) for b, a, w in zip(before, full(), want, strict=True))


def _error(model: nn.Module, want: list[torch.Tensor]) -> float:
    worst = 0.0
    for p, w in zip(model.parameters(), want):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # type: ignore[union-attr]
        worst = max(worst, float((g.cpu() - w).abs().max()))  # type: ignore[union-attr]
    return worst


def _fsdp(mesh: Any, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model().to(device)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def checks() -> dict[str, float]:
    """Every check this world size allows; each returns the max error against the full batch."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    counts = COUNTS[:world] if world > 1 else [3]
    data = batches(sum(counts))
    mine = data[sum(counts[:rank]) : sum(counts[: rank + 1])]
    want = truth(data)
    out: dict[str, float] = {}
    model = make_model().to(device)
    _run(model, MicrobatchAccumulator(model, bucket_mb=1e-4), mine, device)
    out["plain, uneven, weights, many buckets"] = _error(model, want)
    ddp = nn.parallel.DistributedDataParallel(make_model().to(device), device_ids=[device.index] if cuda else None)
    _run(ddp, MicrobatchAccumulator(ddp), mine, device)
    out["DDP (no_sync held), uneven, weights"] = _error(ddp.module, want)
    mesh = init_device_mesh(device.type, (world,))
    fsdp = _fsdp(mesh, device)
    _run(fsdp, MicrobatchAccumulator(fsdp), mine, device)
    out["FSDP2 shards (default), uneven, gradagg pads"] = _error(fsdp, want)
    window = _fsdp(mesh, device)
    _run(window, MicrobatchAccumulator(window, fsdp="window"), mine, device)
    out["FSDP2 window, uneven, weights"] = _error(window, want)
    every = _fsdp(mesh, device)
    _run(every, MicrobatchAccumulator(every, fsdp="every_microbatch"), mine, device, pad=max(counts) - len(mine))
    out["FSDP2 every_microbatch, zero-weight padding"] = _error(every, want)
    attached = _fsdp(mesh, device)
    _attached(attached, mine, device)
    out["FSDP2 window attached, a plain loop, the clip finishes"] = _error(attached, want)
    fsdp1 = _fsdp1(device)
    _run(fsdp1, MicrobatchAccumulator(fsdp1), mine, device)
    out["FSDP1 FULL_SHARD (NO_SHARD on one rank), uneven, gradagg pads"] = _fsdp1_error(fsdp1, want)
    if world == 4:
        hsdp = _fsdp(init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard")), device)
        _run(hsdp, MicrobatchAccumulator(hsdp), mine, device)
        out["HSDP (2 x 2) shards, uneven, gradagg pads"] = _error(hsdp, want)
        hsdp = _fsdp(init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard")), device)
        _run(hsdp, MicrobatchAccumulator(hsdp, fsdp="window"), mine, device)
        out["HSDP (2 x 2) window, uneven, weights"] = _error(hsdp, want)
    return out


def memory_world(form: str, quick: bool) -> dict[str, Any]:
    """bench/bench_fsdp.py's step in ``form`` on this rank's device: the peak allocated bytes and step times."""
    import time

    import bench_fsdp as bf  # bench/, beside this script (sys.path[0] when run as a script)

    size = bf.QUICK if quick else bf.Size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = _device_transformer(size, device)
    world = dist.get_world_size()
    counts = bf.UNEVEN[:world] if "counts" in form else [bf.M] * world
    mine = [t.to(device) for t in bf.batches(size, counts[dist.get_rank()])]
    acc = MicrobatchAccumulator(model, fsdp="window" if "window" in form else "shards") if "gradagg" in form else None
    times, peak = [], 0
    for step in range(1 + size.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        if acc is None:
            bf.fsdp_step(model, mine, sync_off="sync off" in form)
        else:
            bf.gradagg_step(model, acc, mine)
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated())
        dist.barrier()
        if step:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"times": times, "peak": peak}


def _device_transformer(size: Any, device: torch.device) -> nn.Module:
    """bench_fsdp's transformer, fully_shard per block and root, materialised as shards on ``device``."""
    import bench_fsdp as bf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    with torch.device("meta"):
        model = bf.Transformer(size)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)  # a DTensor op: each rank fills its shard
    return model


def memory_table(backend: str, world: int, quick: bool) -> str:
    """Each form of bench/bench_fsdp.py on ``world`` ranks: peak allocated MiB (largest rank), median step time."""
    import statistics

    import bench_fsdp as bf

    rows = []
    for form in bf.FORMS:
        ranks = run_local_world(memory_world, world, form, quick, backend=backend, collective_timeout_s=120.0,
                                timeout_s=1200.0)
        rows.append((form, max(r["peak"] for r in ranks) / 2**20, statistics.median(ranks[0]["times"])))
    base_peak, base_t = next((p, t) for f, p, t in rows if f == bf.BASELINE)
    lines = [f"memory and time, {world} {backend} ranks (torch.cuda.max_memory_allocated; 0 on CPU)"]
    for form, peak, t in rows:
        ratio = f" ({peak / base_peak:.2f}x)" if base_peak else ""
        lines.append(f"  {form:<40} peak {peak:8.1f} MiB{ratio}  step {t:.3f} s ({t / base_t:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    gloo = "--gloo" in argv  # the same checks on CPU gloo ranks (4): a smoke run of this script without a GPU
    if not gloo and not torch.cuda.is_available():
        print("nccl_check: skipped: no CUDA device here (torch.cuda.is_available() is False)")
        return 0
    world = 4 if gloo else min(torch.cuda.device_count(), 4)
    if world == 3:
        world = 2  # the checks use 1, 2 or 4 ranks
    backend = "gloo" if gloo else "nccl"
    results = run_local_world(checks, world, backend=backend, collective_timeout_s=60.0, timeout_s=600.0)
    where = "CPU" if gloo else torch.cuda.get_device_name(0)
    print(f"{backend}, {world} rank(s) on {where}, counts {COUNTS[:world] if world > 1 else [3]}")
    failed = False
    for name in results[0]:
        worst = max(r[name] for r in results)
        ok = worst <= TOL
        failed |= not ok
        print(f"  {name:<48} max error {worst:.1e}  {'ok' if ok else 'FAILED'}")
    if "--memory" in argv and world > 1:
        print(memory_table(backend, world, "--quick" in argv))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
