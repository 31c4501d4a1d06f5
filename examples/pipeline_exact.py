"""Pipeline parallel (torch.distributed.pipelining) with a tied embedding, uneven token counts and a clip.

Run:  python examples/pipeline_exact.py                                   (2 local ranks: 2 stages)
 or:  torchrun --standalone --nproc-per-node 4 examples/pipeline_exact.py  (any number of ranks)
An even world is cut into 2 pipeline stages x world/2 data-parallel replicas, an odd one into 1 stage x
world replicas. Each replica runs 4 microbatches of right-padded sequences per step (a different number of
tokens on each), with GPipe. torch's schedule divides each stage's gradients by its number of microbatches;
PipelineAccumulator makes the step the token mean of the whole global batch instead: the loss is a sum,
the last stage counts the tokens, D is summed once, the tied embedding/head is summed across the two
stages, and the clip counts it once. Each step is compared with one float64 process running the whole
model on the whole batch (trained alongside, with the same clip and SGD); the script exits 1 if it misses.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from gradagg.testing import launched_by_torchrun, run_world
from gradagg.torch import PipelineAccumulator

V, E, T, BLOCKS, MICROBATCHES, STEPS = 11, 8, 6, 4, 4, 3  # vocabulary, width, length, blocks, per step, steps
IGNORE = -100  # a padded position's label: the loss sums no token there
MAX_NORM, LR = 0.5, 0.1
TOLERANCE = 1e-12  # float64: the same sums added in another order differ by a few 1e-16 after 3 steps


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class Stage(nn.Module):
    """Blocks ``lo`` to ``hi`` of the model; the first stage embeds, the last holds the head. The head is the
    embedding (one tensor) when one stage holds both, else a copy of it on the last stage: a tie across ranks."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank builds the same whole model, then keeps its part
        embed, blocks = nn.Embedding(V, E), [Block() for _ in range(BLOCKS)]
        self.embed = embed if lo == 0 else None
        self.blocks = nn.ModuleList(blocks[lo:hi])
        self.head = nn.Parameter(embed.weight.detach().clone()) if hi == BLOCKS and lo > 0 else None
        self.last = hi == BLOCKS
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for b in self.blocks:
            x = b(x)
        if not self.last:
            return x
        return x @ (self.head if self.head is not None else self.embed.weight).T


def microbatch(replica: int, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two right-padded sequences; their lengths (1 to T) differ per replica, step and microbatch."""
    g = torch.Generator().manual_seed(1000 * replica + 10 * step + k)
    ids = torch.randint(0, V, (2, T), generator=g)
    labels = torch.full((2, T), IGNORE)
    for row in range(2):
        n = int(torch.randint(1, T + 1, (1,), generator=g))
        labels[row, : n - 1] = ids[row, 1:n]
    return ids, labels


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss *sum* over the valid tokens, and their count."""
    loss = nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, (labels != IGNORE).sum()


def whole_grads(whole: Stage, replicas: int, step: int) -> dict[str, torch.Tensor]:
    """The one-process truth: the whole model's token-mean gradient over every replica's microbatches, clipped."""
    batches = [microbatch(d, step, k) for d in range(replicas) for k in range(MICROBATCHES)]
    loss, count = token_sum(whole(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches]))
    whole.zero_grad(set_to_none=True)
    (loss / count).backward()
    torch.nn.utils.clip_grad_norm_(whole.parameters(), MAX_NORM)  # one process: the tie is one tensor, once
    grads = {n: p.grad for n, p in whole.named_parameters()}
    grads["head"] = grads["embed.weight"]  # the tie: the head's gradient is the embedding's
    return grads


def train(n_stages: int) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    pp, dp, replicas = rank % n_stages, rank // n_stages, world // n_stages
    pp_groups = [dist.new_group([d * n_stages + p for p in range(n_stages)]) for d in range(replicas)]
    dp_groups = [dist.new_group([d * n_stages + p for d in range(replicas)]) for p in range(n_stages)]
    per = BLOCKS // n_stages
    module = Stage(pp * per, (pp + 1) * per)
    stage = PipelineStage(module, pp, n_stages, torch.device("cpu"), group=pp_groups[dp])
    tied = {"embedding": module.embed.weight if module.embed is not None else module.head} if n_stages > 1 else {}
    pipe = PipelineAccumulator(stage, dp_group=dp_groups[pp], tied=tied)
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=pipe.loss(token_sum))
    sgd = torch.optim.SGD(module.parameters(), lr=LR)
    whole, worst, norms = Stage(0, BLOCKS), 0.0, []
    whole_sgd = torch.optim.SGD(whole.parameters(), lr=LR)
    for step in range(STEPS):
        batches = [microbatch(dp, step, k) for k in range(MICROBATCHES)]
        args = (torch.cat([b[0] for b in batches]),) if stage.is_first else ()
        kwargs = {"target": torch.cat([b[1] for b in batches])} if stage.is_last else {}
        ledger = pipe.step(schedule, *args, **kwargs)
        norms.append(float(pipe.clip_grad_norm_(MAX_NORM)))  # the norm before the clip, the tie counted once
        want = whole_grads(whole, replicas, step)
        worst = max(worst, error(module, want, pp * per))
        sgd.step(), sgd.zero_grad()
        whole_sgd.step()
    total = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    if float(total) > TOLERANCE:
        raise SystemExit(f"rank {rank}: gradagg missed the full-batch gradient by {float(total):.1e}")
    tokens = [int(t) for t in ledger.tokens_per_replica]
    return (f"stage {pp} of {n_stages}, replica {dp} of {replicas}: last step D = {ledger.divisor:g} "
            f"(per replica {tokens}); norms {min(norms):.2f}..{max(norms):.2f} clipped to {MAX_NORM}; "
            f"max error {float(total):.1e}")


def error(module: Stage, want: dict[str, torch.Tensor], first_block: int) -> float:
    """max over this stage's parameters of max |got - want| (block indices shifted to the whole model's)."""
    worst = 0.0
    for name, p in module.named_parameters():
        if name.startswith("blocks."):
            k, rest = name.split(".", 2)[1:]
            name = f"blocks.{first_block + int(k)}.{rest}"
        worst = max(worst, float((p.grad - want[name]).abs().max()))
    return worst


def stages_for(world: int) -> int:
    return 2 if world % 2 == 0 else 1


if __name__ == "__main__":
    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 2  # the launcher's, or 2 local ranks
    for r, line in enumerate(run_world(train, world, stages_for(world))):
        # One write per line: torchrun makes stdout unbuffered, and print() writes the text and its newline
        # separately, so two ranks' lines could interleave.
        sys.stdout.write(f"rank {os.environ['RANK'] if launched_by_torchrun() else r}: {line}\n")
