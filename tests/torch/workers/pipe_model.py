"""A tiny float64 causal transformer with a tied embedding/head, whole (the oracle) or cut into pipeline stages.

The stage modules are copies of the whole model's pieces (same initial values); the last stage's head is a
separate tensor equal to the embedding, as in a pipelined run, where the two live on different ranks. The
last stage also holds ``unused``, a layer that never runs (absent on every replica, its gradient stays None)
unless ``extra`` is set on a replica's last stage: then it runs there only (present on one replica, absent on
the other), and the oracle runs it on that replica's microbatches only.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

V, E, T, HEADS, BLOCKS = 13, 8, 6, 2, 4  # vocabulary, width, sequence length, heads, transformer blocks
IGNORE = -100  # the label of a padded position: the loss sums no token there


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Whole(nn.Module):
    """The one-process model: the head is the embedding (one tensor, used twice)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.embed = nn.Embedding(V, E)
        self.pos = nn.Parameter(torch.randn(T, E) * 0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(E)
        self.unused = nn.Linear(E, 1)
        self.double()

    def forward(self, ids: torch.Tensor, extra: bool = False) -> torch.Tensor:
        x = self.embed(ids) + self.pos
        for b in self.blocks:
            x = b(x)
        return _extra(self.norm(x), self.unused, extra) @ self.embed.weight.T


def _extra(x: torch.Tensor, unused: nn.Linear, extra: bool) -> torch.Tensor:
    """``unused`` adds a learned scalar per position when ``extra`` is set; otherwise it does not run."""
    return x + unused(x) if extra else x


class First(nn.Module):
    def __init__(self, whole: Whole, blocks: list[Block]) -> None:
        super().__init__()
        self.embed, self.pos = copy.deepcopy(whole.embed), copy.deepcopy(whole.pos)
        self.blocks = nn.ModuleList(copy.deepcopy(blocks))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos
        for b in self.blocks:
            x = b(x)
        return x


class Middle(nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(copy.deepcopy(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class Last(Middle):
    def __init__(self, whole: Whole, blocks: list[Block]) -> None:
        super().__init__(blocks)
        self.norm, self.unused = copy.deepcopy(whole.norm), copy.deepcopy(whole.unused)
        self.head = nn.Parameter(whole.embed.weight.detach().clone())  # tied to First.embed.weight
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _extra(self.norm(super().forward(x)), self.unused, self.extra) @ self.head.T


def stage_module(whole: Whole, index: int, n_stages: int) -> nn.Module:
    """Stage ``index`` of ``n_stages``: the blocks split evenly, embedding first, norm and head last."""
    per = BLOCKS // n_stages
    blocks = list(whole.blocks)[index * per:(index + 1) * per]
    if index == 0:
        return First(whole, blocks)
    return Last(whole, blocks) if index == n_stages - 1 else Middle(blocks)


def whole_names(index: int, n_stages: int, name: str) -> str:
    """The whole model's name for stage ``index``'s parameter ``name`` (the head is the embedding)."""
    if name == "head":
        return "embed.weight"
    if name.startswith("blocks."):
        k, rest = name.split(".", 2)[1:]
        return f"blocks.{index * (BLOCKS // n_stages) + int(k)}.{rest}"
    return name


def microbatch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels of right-padded sequences; the labels count ``sum(lengths) - rows``
    tokens (a sequence of length L predicts L - 1), and a row of length 0 or 1 counts none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (len(lengths), T), generator=g)
    labels = torch.full((len(lengths), T), IGNORE)
    for r, n in enumerate(lengths):
        labels[r, :max(n - 1, 0)] = ids[r, 1:max(n, 1)]
    return ids, labels


def token_sum_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss *sum* over the valid tokens, and how many there are (the count)."""
    loss = nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE,
                                       reduction="sum")
    return loss, (labels != IGNORE).sum()


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a schedule's user writes for a mean: each microbatch's own token mean (NaN if it has none)."""
    return nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE)


def truth(batches: list[tuple[torch.Tensor, torch.Tensor]],
          extra: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[dict[str, torch.Tensor], float]:
    """The whole model's gradients of the token mean over every batch at once (``extra``'s through ``unused``),
    and their 2-norm."""
    whole = Whole()
    loss, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    for group, through in ((batches, False), (extra, True)):
        if group:
            ids, labels = torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group])
            s, c = token_sum_loss(whole(ids, extra=through), labels)
            loss, count = loss + s, count + c
    (loss / count).backward()
    grads = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    return grads, float(norm)
