"""FSDP2 (fully_shard) with uneven microbatch counts, a rank with none included, and token weights.

Run:  python examples/fsdp2_uneven.py
 or:  torchrun --standalone --nproc-per-node 2 examples/fsdp2_uneven.py   (any number of ranks)
Rank 0 runs no microbatch this window, rank 1 runs 3 (further ranks 2, 0, 1, 2, ...). FSDP's own reduce-
scatter would run once per microbatch (a different number of times on each rank: it would hang) and
divide by the world size; MicrobatchAccumulator(model) (fsdp="shards", the default) keeps sharded
gradients only: the ranks agree before each microbatch, rank 0 runs three padding microbatches (its
gradients dropped, so FSDP's collectives pair up and it adds exactly zero), and finish() divides by the
counted D. The gradients are DTensor shards; the script compares their full tensors with one
forward/backward of the whole batch.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradagg.testing import launched_by_torchrun, run_world
from gradagg.torch import MicrobatchAccumulator

TOLERANCE = 1e-12  # float64: the same sums added in another order differ by a few 1e-17


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def counts_for(world: int) -> list[int]:
    """Microbatches per rank: 0 and 3 on two ranks, then 2, 0, 1, 2, ... on any further ones."""
    return [0, 3, *((2 + r) % 3 for r in range(world - 2))][:world]


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for k in range(n):
        x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g, dtype=torch.float64)
        batches.append((x, y, torch.arange(8) < 3 + 2 * (k % 3)))  # 3, 5, 7, 3, ... valid tokens
    return batches


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y)[valid] ** 2).sum()


def train_step(counts: list[int]) -> str:
    rank = dist.get_rank()
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acc = MicrobatchAccumulator(model)  # fsdp="shards": sharded gradients only, any counts per rank
    batches = make_batches(sum(counts))
    for x, y, valid in acc.microbatches(batches[sum(counts[:rank]) : sum(counts[: rank + 1])]):
        with acc.microbatch(weight=int(valid.sum())):
            loss_sum(model, x, y, valid).backward()
    ledger = acc.finish()
    grads = [p.grad.full_tensor() for p in model.parameters()]  # DTensor shards -> whole (a collective)

    truth = make_model()
    x, y, valid = (torch.cat([b[i] for b in batches]) for i in range(3))
    (loss_sum(truth, x, y, valid) / int(valid.sum())).backward()
    error = max(float((g - q.grad).abs().max()) for g, q in zip(grads, truth.parameters()))
    if error > TOLERANCE:
        raise SystemExit(f"rank {rank}: gradagg missed the full-batch gradient by {error:.1e}")
    kind = type(next(model.parameters()).grad).__name__
    counts_seen = list(ledger.microbatches_per_rank or ())
    return f"counts {counts_seen}, D = {ledger.divisor:g}; .grad is a {kind}; max error {error:.1e}"


if __name__ == "__main__":
    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 2  # the launcher's, or 2 local ranks
    for r, line in enumerate(run_world(train_step, world, counts_for(world))):
        # One write per line: torchrun makes stdout unbuffered, and print() writes the text and its newline
        # separately, so two ranks' lines could interleave.
        sys.stdout.write(f"rank {os.environ['RANK'] if launched_by_torchrun() else r}: {line}\n")
