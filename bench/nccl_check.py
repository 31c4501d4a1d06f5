"""The training checks on CUDA and NCCL: plain, DDP, FSDP2 and HSDP accumulation against the full batch.

Run: ``.venv/bin/python bench/nccl_check.py`` on a machine with CUDA (``--gloo``: the same checks on 4
CPU gloo ranks, to try the script without a GPU). One rank per GPU, up to 4:
with 2 or more GPUs the ranks run uneven microbatch counts (one rank none) with token weights, under a
plain module, DDP and FSDP2 (window and every-microbatch forms); with 4, HSDP on a (2, 2) mesh as well.
With one GPU, a one-rank NCCL world runs the same code paths (buffers and DTensors on the device, no
cross-rank traffic). Each check compares with one forward/backward of the whole batch in float64 on the
CPU; the tolerance is 1e-10 (float64 sums in another order, on another device's kernels). Exit status: 0
when every check passes or when there is no CUDA device (the reason is printed), 1 otherwise.
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
    out["FSDP2 window, uneven, weights"] = _error(fsdp, want)
    every = _fsdp(mesh, device)
    _run(every, MicrobatchAccumulator(every, fsdp="every_microbatch"), mine, device, pad=max(counts) - len(mine))
    out["FSDP2 every_microbatch, zero-weight padding"] = _error(every, want)
    if world == 4:
        hsdp = _fsdp(init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard")), device)
        _run(hsdp, MicrobatchAccumulator(hsdp), mine, device)
        out["HSDP (2 x 2), uneven, weights"] = _error(hsdp, want)
    return out


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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
