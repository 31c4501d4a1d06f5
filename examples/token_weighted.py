"""Token-weighted accumulation: the gradient of the global token mean, with uneven microbatch counts.

Run:  python examples/token_weighted.py
 or:  torchrun --standalone --nproc-per-node 2 examples/token_weighted.py   (any number of ranks)
Each microbatch holds 4 sequences of up to 5 tokens, padded (label -100 = ignore). Rank 0 runs 2
microbatches, rank 1 runs 3 (further ranks 1 to 3). Every rank backpropagates the SUM of its token
losses and weights each microbatch by its number of valid tokens; finish() divides by D = all valid
tokens of all ranks. The script checks the result against one forward/backward of the whole batch, and
shows what averaging over microbatches (the mean of per-microbatch token means) gives.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from gradagg.testing import launched_by_torchrun, run_world
from gradagg.torch import MicrobatchAccumulator

VOCAB, DIM, IGNORE = 11, 8, -100
TOLERANCE = 1e-12  # float64: the same sums added in another order differ by a few 1e-17


def counts_for(world: int) -> list[int]:
    """Microbatches per rank: 2 and 3 on two ranks, then 1, 2, 3, 1, ... on any further ones."""
    return [2, 3, *(1 + r % 3 for r in range(2, world))][:world]


def model_and_data(n: int) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)  # the same weights and batches on every rank
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)).double()
    batches = []
    for k in range(n):  # the global window: n microbatches
        tokens = torch.randint(0, VOCAB, (4, 5))
        labels = torch.randint(0, VOCAB, (4, 5))
        lengths = torch.tensor([5, 1 + k % 5, 2, 4 - k % 3])
        labels[torch.arange(5) >= lengths[:, None]] = IGNORE  # padding
        batches.append((tokens, labels))
    return model, batches


def token_loss_sum(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=IGNORE, reduction="sum")


def train_step(counts: list[int]) -> str:
    rank = dist.get_rank()
    model, batches = model_and_data(sum(counts))
    mine = batches[sum(counts[:rank]) : sum(counts[: rank + 1])]
    acc = MicrobatchAccumulator(model)
    for tokens, labels in acc.microbatches(mine):  # marks the last microbatch: its buckets leave during backward
        with acc.microbatch(weight=int((labels != IGNORE).sum())):
            token_loss_sum(model, tokens, labels).backward()  # the sum over tokens, not the mean
    ledger = acc.finish()

    truth, _ = model_and_data(sum(counts))  # the whole window in one process: the mean over every valid token
    tokens, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    (token_loss_sum(truth, tokens, labels) / int((labels != IGNORE).sum())).backward()
    wrong, _ = model_and_data(sum(counts))  # what many loops ship: the mean over microbatches of each one's token mean
    sum(token_loss_sum(wrong, t, y) / int((y != IGNORE).sum()) / len(batches) for t, y in batches).backward()
    error = _diff(model, truth)
    if error > TOLERANCE:
        raise SystemExit(f"rank {rank}: gradagg missed the full-batch gradient by {error:.1e}")
    return (
        f"D = {ledger.divisor:g} tokens (per rank {list(ledger.weight_per_rank or ())}), M = "
        f"{ledger.microbatches_global}; max error vs the full batch {error:.1e} "
        f"(mean of microbatch means: {_diff(wrong, truth):.1e})"
    )


def _diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.grad - q.grad).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


if __name__ == "__main__":
    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 2  # the launcher's, or 2 local ranks
    for r, line in enumerate(run_world(train_step, world, counts_for(world))):
        # One write per line: torchrun makes stdout unbuffered, and print() writes the text and its newline
        # separately, so two ranks' lines could interleave.
        sys.stdout.write(f"rank {os.environ['RANK'] if launched_by_torchrun() else r}: {line}\n")
