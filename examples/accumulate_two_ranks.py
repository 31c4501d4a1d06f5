"""Two ranks with uneven microbatch counts: gradagg divides by the counted M.

Run either way (both use one world of 2 ranks, never one inside the other):
    python examples/accumulate_two_ranks.py                                        # starts 2 local gloo ranks
    torchrun --standalone --nproc-per-node 2 examples/accumulate_two_ranks.py      # uses torchrun's world
Rank 0 runs 1 microbatch and rank 1 runs 3; the gradient of each microbatch is its input x,
so the exact mean is (0 + 10 + 11 + 12) / 4 = 8.25 on every rank. DDP with `loss / local_count`
would give ((0) / 1 + (10 + 11 + 12) / 3) / 2 = 5.5.
"""

import os
import sys

import torch
import torch.distributed as dist

from gradagg.testing import launched_by_torchrun, run_world
from gradagg.torch import MicrobatchAccumulator


def train_step(counts: list[int]) -> tuple[float | None, list[float]]:
    rank = dist.get_rank()
    model = torch.nn.Linear(2, 1, bias=False)
    acc = MicrobatchAccumulator(model)
    for k in range(counts[rank]):  # rank 0 runs 1 microbatch, rank 1 runs 3
        with acc.microbatch():
            x = torch.full((1, 2), float(10 * rank + k))
            model(x).sum().backward()  # the unscaled loss; its gradient is x
    ledger = acc.finish()  # one all_reduce: gradients, M and participation
    assert model.weight.grad is not None
    return ledger.divisor, model.weight.grad.flatten().tolist()


if __name__ == "__main__":
    results = run_world(train_step, 2, [1, 3])  # (0 + 10 + 11 + 12) / M, M = 4
    # One write per line: torchrun makes stdout unbuffered, and two ranks' print() calls could interleave.
    sys.stdout.write(f"rank {os.environ['RANK']}: {results[0]}\n" if launched_by_torchrun() else f"{results}\n")
