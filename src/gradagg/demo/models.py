"""The demo's two float64 models, their seeded initial values, and the losses whose gradients are compared.

* :class:`MoE`: a top-1 mixture of experts; an expert no token of a microbatch chose does not run there,
  so its parameters are *absent* (no gradient, not a zero gradient). ``head_b``, the linear term of the
  last rank's domain, lives outside the module: it is replicated on every rank and owned by the last one.
* :class:`TokenLM`: a tiny language model over padded sequences; padding targets are :data:`IGNORE`.

Both are ``torch.nn.Module`` so that gradagg's copy can be wrapped (DDP, FSDP2); the wrong approaches and
the ground truth evaluate a plain copy with a dictionary of values (``torch.func.functional_call``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

Params = dict[str, torch.Tensor]
M = TypeVar("M", bound=nn.Module)
DTYPE = torch.float64  # the ground truth is meaningful to ~1e-16, so any real error stands out
HEAD = "head_b"  # the MoE's replicated parameter with one declared owner (the last rank)
DIM, EXPERTS = 4, 4
VOCAB, EMBED, BLOCKS = 16, 8, 2
IGNORE = -100  # the target of a padding position: cross_entropy(..., ignore_index=IGNORE) skips it


class MoE(nn.Module):
    """Top-1 mixture of experts, then a linear read-out: ``gate * tanh(expert(x)) . out``.

    >>> MoE()(torch.zeros(3, DIM, dtype=DTYPE)).shape
    torch.Size([3])
    """

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.zeros(EXPERTS, DIM, dtype=DTYPE))
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM, dtype=DTYPE) for _ in range(EXPERTS))
        self.out = nn.Parameter(torch.zeros(DIM, dtype=DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, choice = torch.softmax(x @ self.router.T, dim=-1).max(dim=-1)
        hidden = torch.zeros_like(x)
        for e in torch.unique(choice).tolist():  # an expert no token chose does not run: absent, not zero
            idx = (choice == e).nonzero().squeeze(1)
            hidden = hidden.index_copy(0, idx, torch.tanh(self.experts[e](x[idx])))
        return (gate.unsqueeze(1) * hidden) @ self.out  # the gate carries the router's gradient

    def shard_units(self) -> list[nn.Module]:
        """The submodules FSDP2 shards on their own (then the root): the experts."""
        return list(self.experts)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(EMBED, EMBED, dtype=DTYPE)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.linear(h))


class TokenLM(nn.Module):
    """Embedding, residual tanh blocks, a linear head: logits ``[batch * length, VOCAB]`` for token ids.

    >>> TokenLM()(torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([10, 16])
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED, dtype=DTYPE)
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))
        self.head = nn.Linear(EMBED, VOCAB, dtype=DTYPE)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens.reshape(-1))  # flat: every output below is a fresh tensor, never a view
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]

    def shard_units(self) -> list[nn.Module]:
        """The submodules FSDP2 shards on their own (then the root): the blocks."""
        return list(self.blocks)


def initial_values(module: nn.Module, seed: int, extra: dict[str, tuple[int, ...]] | None = None) -> Params:
    """Seeded initial values for ``module``'s parameters (and ``extra`` named shapes), as float64 leaves.

    Weights are drawn with scale fan_in^-1/2, biases 0.1, the router and the embedding 1; the same on
    every rank and every run with the same seed (a generator of their own, not torch's global one).

    Args:
        module: the model whose ``named_parameters()`` give the names and shapes.
        seed: the seed.
        extra: more parameters outside the module, name -> shape (the MoE's ``head_b``), drawn with scale 0.1.

    Returns:
        name -> a leaf tensor that requires grad.

    >>> sorted(initial_values(MoE(), 0, {HEAD: (DIM,)}))[:3]
    ['experts.0.bias', 'experts.0.weight', 'experts.1.bias']
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()} | dict(extra or {})
    out: Params = {}
    for name, shape in shapes.items():
        scale = _scale(name, shape, name in (extra or {}))
        out[name] = (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).requires_grad_()
    return out


def _scale(name: str, shape: tuple[int, ...], extra: bool) -> float:
    if extra or name.endswith("bias"):
        return 0.1
    if name in ("router", "embed.weight"):
        return 1.0
    return 1.0 / math.sqrt(shape[-1])  # fan-in of a weight (and of MoE.out, a read-out vector)


def load(module: M, values: Params) -> M:
    """Copy ``values`` into ``module``'s parameters (names as ``named_parameters()``); return ``module``.

    >>> lm = load(TokenLM(), initial_values(TokenLM(), 3))
    >>> bool(lm.head.weight.requires_grad)
    True
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(values[name])
    return module


def moe_loss(
    trunk: Callable[[torch.Tensor], torch.Tensor], head: torch.Tensor, mb: tuple[torch.Tensor, torch.Tensor, bool]
) -> torch.Tensor:
    """Mean squared error of one MoE microbatch (its tokens all count); domain B adds ``x . head_b``.

    >>> x = torch.ones(3, DIM, dtype=DTYPE)
    >>> float(moe_loss(MoE(), torch.zeros(DIM, dtype=DTYPE), (x, torch.ones(3, dtype=DTYPE), True)).detach())
    1.0
    """
    x, target, domain_b = mb
    y = trunk(x)
    if domain_b:
        y = y + x @ head
    return ((y - target) ** 2).mean()


def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy over the valid (not :data:`IGNORE`) targets: their sum (default) or their mean.

    >>> import math
    >>> logits = torch.zeros(3, VOCAB, dtype=DTYPE)
    >>> round(float(token_loss(logits, torch.tensor([1, IGNORE, 2]))) / math.log(VOCAB), 9)  # 2 tokens, log 16 each
    2.0
    """
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction=reduction)  # type: ignore[no-any-return]
