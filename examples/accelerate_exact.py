"""An Accelerate loop made exact with one line: ``acc = exact(accelerator, model, optimizer)``.

Run:  torchrun --standalone --nproc-per-node 2 examples/accelerate_exact.py   (any number of ranks)
 or:  python examples/accelerate_exact.py                                      (one process)
A tiny token model, 20 padded sequences of 2 to 9 tokens (label -100 = ignore), 2 per microbatch, 3 microbatches
per optimizer step (the last window of the epoch shorter). Each microbatch back-propagates the SUM of its token
losses inside ``acc.microbatch(weight=its tokens)``; every step's gradient is checked against one float64
forward/backward of exactly the sequences that step consumed on all ranks. On a CPU machine the Accelerator
needs ``cpu=True``: without it, under torchrun, each rank would train alone.
"""

import copy
import random

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from gradagg.integrations.accelerate import exact

VOCAB, IGNORE, STEPS = 16, -100, 3
TOLERANCE = 1e-5  # float32 sums of a few dozen token losses, against float64: round-off near 1e-7
rng = random.Random(0)
SEQS = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(20)]


def collate(indices: list[int]) -> dict[str, torch.Tensor]:
    width = max(len(SEQS[i]) for i in indices)
    x = torch.zeros(len(indices), width, dtype=torch.long)
    y = torch.full((len(indices), width), IGNORE)
    for row, i in enumerate(indices):
        s = torch.tensor(SEQS[i])
        x[row, : len(s)], y[row, : len(s) - 1] = s, s[1:]  # predict the next token; padding is ignored
    return {"x": x, "y": y, "idx": torch.tensor(indices)}


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="sum")


def truth(start: nn.Module, consumed: list[int]) -> list[torch.Tensor]:
    """float64 gradient of the token mean over ``consumed``: one forward/backward of them all."""
    m = copy.deepcopy(start).double()
    batch = collate(consumed)
    (loss_sum(m, batch) / (batch["y"] != IGNORE).sum()).backward()
    return [p.grad for p in m.parameters()]


def say(line: str) -> None:
    """Rank 0 prints every rank's line, whole and in rank order: ranks printing to one terminal at once would
    run their lines into each other."""
    if not dist.is_initialized():
        print(line, flush=True)
        return
    every: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(every, line)
    if dist.get_rank() == 0:
        print("\n".join(every), flush=True)


def gathered(mine: list[int]) -> list[int]:
    if not dist.is_initialized():
        return mine
    every: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    return sorted(i for part in every for i in part)


def main() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(list(range(len(SEQS))), batch_size=2, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    acc = exact(accelerator, model, optimizer)  # the one line
    plain, start, consumed = accelerator.unwrap_model(model), None, []
    for batch in loader:
        with accelerator.accumulate(model):
            start = start or copy.deepcopy(plain)
            consumed += batch.pop("idx").tolist()
            with acc.microbatch(weight=(batch["y"] != IGNORE).sum()):
                accelerator.backward(loss_sum(model, batch))
            if accelerator.sync_gradients:  # the window was finished: the exact gradient
                accelerator.clip_grad_norm_(model.parameters(), 10.0)
                want = truth(start, gathered(consumed))
                err = max(float((p.grad - w).abs().max()) for p, w in zip(plain.parameters(), want, strict=True))
                say(f"rank {accelerator.process_index}: step of {acc.ledger.microbatches_global} microbatches, "
                    f"D = {acc.ledger.divisor:g} tokens, max error vs the full batch {err:.1e}")
                assert err < TOLERANCE, err
                start, consumed = None, []
            optimizer.step()
            optimizer.zero_grad()
    # the process group closed before the interpreter exits: left to the exit, gloo's threads were once torn down
    # mid-flight under load ("terminate called without an active exception", the rank's exit status -6)
    accelerator.end_training()


if __name__ == "__main__":
    main()
