"""The demo's data: every step's global batch, the same on every rank (seeded by seed, case and step).

* MoE: :data:`MOE_TOKENS` tokens of :data:`~gradagg.demo.models.DIM` features per microbatch (few, so
  that experts are often absent), targets from a fixed teacher; the last rank's microbatches come from a
  second domain, "B", which adds a linear term (the one ``head_b`` learns).
* Tokens: :data:`SEQS` sequences per microbatch of 1 to :data:`LENGTH` valid tokens each, padded to
  :data:`LENGTH` (inputs with :data:`PAD`, targets with :data:`~gradagg.demo.models.IGNORE`), so the
  valid-token counts differ from microbatch to microbatch and from rank to rank. Targets: a fixed
  permutation of the input token, replaced by a random token 20% of the time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

import torch

from gradagg.demo.models import DIM, DTYPE, IGNORE, VOCAB
from gradagg.demo.options import Config

MoeMicrobatch = tuple[torch.Tensor, torch.Tensor, bool]  # (x [tokens, DIM], target [tokens], domain B?)
TokenMicrobatch = tuple[torch.Tensor, torch.Tensor]  # (inputs [SEQS, LENGTH], targets [SEQS, LENGTH])
T = TypeVar("T")

MOE_TOKENS = 3
SEQS, LENGTH, PAD = 2, 8, 0
NOISE = 0.2  # the share of targets that are random tokens instead of the teacher's
_TEACHER, _HELD_OUT = -2, -1  # random streams besides the steps' (0, 1, ...)
HELD_OUT_REPEAT = 4  # the held-out set: four steps' worth of microbatches


def generator(cfg: Config, case: str, stream: int) -> torch.Generator:
    """A generator of its own for each (seed, case, stream): no two streams share numbers.

    >>> cfg = Config(steps=1, seed=0, counts=(1, 1))
    >>> a, b = generator(cfg, "moe", 0), generator(cfg, "tokens", 0)
    >>> bool(torch.rand(1, generator=a) != torch.rand(1, generator=b))
    True
    """
    digest = hashlib.sha256(f"gradagg-demo/{case}/{cfg.seed}/{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def mine(cfg: Config, batch: Sequence[T], rank: int) -> list[T]:
    """Rank ``rank``'s microbatches of a global batch laid out rank by rank.

    >>> mine(Config(steps=1, seed=0, counts=(1, 2)), "abc", 1)
    ['b', 'c']
    """
    start = sum(cfg.counts[:rank])
    return list(batch[start : start + cfg.counts[rank]])


def moe_batch(cfg: Config, step: int, repeat: int = 1) -> list[MoeMicrobatch]:
    """Every MoE microbatch of one step, rank by rank; ``repeat`` multiplies every rank's count.

    >>> batch = moe_batch(Config(steps=1, seed=0, counts=(1, 2)), 0)
    >>> [(tuple(x.shape), b) for x, _, b in batch]
    [((3, 4), False), ((3, 4), True), ((3, 4), True)]
    """
    a, c = torch.randn(2, DIM, generator=generator(cfg, "moe", _TEACHER), dtype=DTYPE)
    gen = generator(cfg, "moe", step)
    batch: list[MoeMicrobatch] = []
    for rank, count in enumerate(cfg.counts):
        for _ in range(count * repeat):
            x = torch.randn(MOE_TOKENS, DIM, generator=gen, dtype=DTYPE)
            domain_b = rank == cfg.owner
            noise = 0.05 * torch.randn(MOE_TOKENS, generator=gen, dtype=DTYPE)
            batch.append((x, torch.sin(2 * x @ a) + (x @ c if domain_b else 0.0) + noise, domain_b))
    return batch


def moe_held_out(cfg: Config) -> list[MoeMicrobatch]:
    """A fixed MoE evaluation set, four steps' worth, as one microbatch per domain (two forwards, not 32)."""
    batch = moe_batch(cfg, step=_HELD_OUT, repeat=HELD_OUT_REPEAT)
    return [(torch.cat([x for x, _, b in batch if b == domain]), torch.cat([y for _, y, b in batch if b == domain]),
             domain) for domain in (False, True)]


def token_batch(cfg: Config, step: int, repeat: int = 1) -> list[TokenMicrobatch]:
    """Every token microbatch of one step, rank by rank: padded sequences of uneven valid lengths.

    >>> batch = token_batch(Config(steps=1, seed=0, counts=(1, 2)), 0)
    >>> [tuple(y.shape) for _, y in batch], all(1 <= valid_tokens(y) <= SEQS * LENGTH for _, y in batch)
    ([(2, 8), (2, 8), (2, 8)], True)
    """
    perm = torch.randperm(VOCAB, generator=generator(cfg, "tokens", _TEACHER))
    gen = generator(cfg, "tokens", step)
    batch: list[TokenMicrobatch] = []
    for _ in range(sum(cfg.counts) * repeat):
        inputs = torch.randint(0, VOCAB, (SEQS, LENGTH), generator=gen)
        noisy = torch.rand(SEQS, LENGTH, generator=gen) < NOISE
        targets = torch.where(noisy, torch.randint(0, VOCAB, (SEQS, LENGTH), generator=gen), perm[inputs])
        lengths = torch.randint(1, LENGTH + 1, (SEQS,), generator=gen)
        padding = torch.arange(LENGTH) >= lengths.unsqueeze(1)
        batch.append((inputs.masked_fill(padding, PAD), targets.masked_fill(padding, IGNORE)))
    return batch


def token_held_out(cfg: Config) -> list[TokenMicrobatch]:
    """A fixed token evaluation set, four steps' worth, as one microbatch."""
    batch = token_batch(cfg, step=_HELD_OUT, repeat=HELD_OUT_REPEAT)
    return [(torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch]))]


def valid_tokens(targets: torch.Tensor) -> int:
    """The number of valid (not padding) targets: a microbatch's weight.

    >>> valid_tokens(torch.tensor([[3, IGNORE], [1, 2]]))
    3
    """
    return int((targets != IGNORE).sum())
