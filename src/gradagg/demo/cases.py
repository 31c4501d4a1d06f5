"""The demo's two cases: for each, its model, data, losses, ground truth and approaches, in one place.

* ``tokens``: a language model over padded sequences of uneven lengths. The truth is the gradient of the
  token mean of the cross-entropy over every valid token of the global batch; gradagg gets it from
  summed microbatch losses with ``weight=`` their valid tokens.
* ``moe``: a mixture of experts (experts absent from some microbatches) and a replicated ``head_b`` owned
  by the last rank. The truth is the gradient of the mean of the M equal-sized microbatch losses.

The ground truth and the wrong approaches evaluate one plain copy of the model per case (its parameters
overwritten with the values in question: :meth:`Case.bind`), so they never touch gradagg's wrapped model
or its hooks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from gradagg.demo import approaches, data
from gradagg.demo.approaches import GradaggRun, MoeGradagg, RankRows, TokenGradagg
from gradagg.demo.models import (
    HEAD,
    IGNORE,
    VOCAB,
    MoE,
    Params,
    TokenLM,
    initial_values,
    load,
    moe_loss,
    token_loss,
)
from gradagg.demo.options import Config
from gradagg.demo.results import ApproachInfo


class Case(ABC):
    """What the training loop needs from a case; :class:`TokenCase` and :class:`MoeCase` fill it in.

    Args:
        plain: an unwrapped model of the case, used only to evaluate the truth and the wrong approaches.
    """

    name: str
    title: str
    approaches: tuple[ApproachInfo, ...]
    lr: float

    def __init__(self, plain: torch.nn.Module) -> None:
        self.plain = plain

    @abstractmethod
    def details(self, cfg: Config) -> list[str]:
        """Lines describing the model, the data and the ground truth."""

    @abstractmethod
    def start(self, cfg: Config) -> Params:
        """The initial values, the same for every approach and rank."""

    @abstractmethod
    def gradagg(self, values: Params, cfg: Config, rank: int) -> GradaggRun:
        """gradagg's model copy, wrapped as ``cfg.wrap`` says."""

    @abstractmethod
    def batch(self, cfg: Config, step: int) -> list[Any]:
        """Every microbatch of one step, rank by rank."""

    @abstractmethod
    def held_out(self, cfg: Config) -> list[Any]:
        """A fixed evaluation set."""

    @abstractmethod
    def row_loss(self, leaves: Params, mb: Any) -> torch.Tensor:
        """The unscaled loss of one microbatch, whose gradient a rank contributes (``leaves`` from :meth:`bind`)."""

    @abstractmethod
    def truth_loss(self, leaves: Params, batch: Sequence[Any]) -> torch.Tensor:
        """The full-batch loss whose gradient is the ground truth (``leaves`` from :meth:`bind`)."""

    @abstractmethod
    def tokens(self, mb: Any) -> int:
        """What a microbatch counts for in a token divisor."""

    def stale_after(self, grads: Params, rank: int, cfg: Config) -> torch.Tensor | None:
        """What a rank's replica of a replicated parameter's gradient holds until the next step (None: nothing)."""
        return None

    def bind(self, params: Params) -> Params:
        """Copy ``params`` into the case's plain model; return its parameters, and leaves for the others.

        The plain model is shared by every approach of the case, used one after the other: cheaper than
        ``torch.func.functional_call``, which re-registers every parameter on every call.
        """
        with torch.no_grad():
            for n, p in self.plain.named_parameters():
                p.copy_(params[n])
        leaves = dict(self.plain.named_parameters())
        return leaves | {n: t.detach().clone().requires_grad_() for n, t in params.items() if n not in leaves}

    def eval_loss(self, params: Params, held: list[Any]) -> float:
        """The held-out loss (the plot's left panel): :meth:`truth_loss` over ``held``, without gradients."""
        with torch.no_grad():
            return float(self.truth_loss(self.bind(params), held))

    def truth(self, params: Params, batch: Sequence[Any]) -> Params:
        """The ground truth: the gradient of :meth:`truth_loss` over the whole global batch, in this process."""
        leaves = self.bind(params)
        grads = torch.autograd.grad(self.truth_loss(leaves, batch), list(leaves.values()), allow_unused=True)
        return {n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(leaves.items(), grads)}

    def rows(self, params: Params, mine: Sequence[Any], stale: torch.Tensor | None) -> RankRows:
        """Each of this rank's microbatches' gradient (None where a parameter was absent), and its tokens."""
        leaves = self.bind(params)
        names, tensors = list(leaves), list(leaves.values())
        rows: list[dict[str, torch.Tensor | None]] = []
        for mb in mine:
            grads = torch.autograd.grad(self.row_loss(leaves, mb), tensors, allow_unused=True)
            rows.append(dict(zip(names, grads)))
        return RankRows(rows, [self.tokens(mb) for mb in mine], stale)


class TokenCase(Case):
    """Padded variable-length sequences, cross-entropy with ``ignore_index``, the token mean as truth."""

    name, title, lr = "tokens", "token-weighted: padded sequences of uneven lengths", 0.5
    approaches = approaches.TOKEN_APPROACHES

    plain: TokenLM

    def __init__(self) -> None:
        super().__init__(TokenLM())

    def details(self, cfg: Config) -> list[str]:
        return [
            f"model: a tiny language model (embedding, 2 residual blocks, a head over {VOCAB} tokens); each "
            f"microbatch:\n       {data.SEQS} sequences of 1 to {data.LENGTH} valid tokens, padded to {data.LENGTH}, "
            f"padding targets ignore_index={IGNORE}",
            "ground truth: the gradient of the cross-entropy averaged over every valid token of the global batch,\n"
            "              in one process, every step",
        ]

    def start(self, cfg: Config) -> Params:
        return initial_values(self.plain, cfg.seed)

    def gradagg(self, values: Params, cfg: Config, rank: int) -> GradaggRun:
        return TokenGradagg(load(TokenLM(), values), cfg, self.lr)

    def batch(self, cfg: Config, step: int) -> list[Any]:
        return data.token_batch(cfg, step)

    def held_out(self, cfg: Config) -> list[Any]:
        return data.token_held_out(cfg)

    def row_loss(self, leaves: Params, mb: Any) -> torch.Tensor:
        inputs, targets = mb
        return token_loss(self.plain(inputs), targets)

    def truth_loss(self, leaves: Params, batch: Sequence[Any]) -> torch.Tensor:
        inputs, targets = torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch])
        return token_loss(self.plain(inputs), targets, reduction="mean")

    def tokens(self, mb: Any) -> int:
        return data.valid_tokens(mb[1])


class MoeCase(Case):
    """Experts absent from some microbatches; ``head_b`` replicated, owned by the last rank; uneven counts."""

    name, title, lr = "moe", "mixture of experts with an owned replica", 0.3
    approaches = approaches.MOE_APPROACHES

    plain: MoE

    def __init__(self) -> None:
        super().__init__(MoE())

    def details(self, cfg: Config) -> list[str]:
        return [
            f"model: top-1 mixture of {len(self.plain.experts)} experts, {data.MOE_TOKENS} tokens per microbatch "
            f"(an expert no token chose is absent there);\n       {HEAD} replicated on every rank, owned by rank "
            f"{cfg.owner}, used by its data only",
            "ground truth: the gradient of (1/M) sum_i loss_i over the whole global batch, in one process, every step",
        ]

    def start(self, cfg: Config) -> Params:
        return initial_values(self.plain, cfg.seed, {HEAD: (self.plain.out.shape[0],)})

    def gradagg(self, values: Params, cfg: Config, rank: int) -> GradaggRun:
        trunk = {n: t for n, t in values.items() if n != HEAD}
        return MoeGradagg(load(MoE(), trunk), values[HEAD], cfg, self.lr, rank)

    def batch(self, cfg: Config, step: int) -> list[Any]:
        return data.moe_batch(cfg, step)

    def held_out(self, cfg: Config) -> list[Any]:
        return data.moe_held_out(cfg)

    def row_loss(self, leaves: Params, mb: Any) -> torch.Tensor:
        return moe_loss(self.plain, leaves[HEAD], mb)

    def truth_loss(self, leaves: Params, batch: Sequence[Any]) -> torch.Tensor:
        return torch.stack([self.row_loss(leaves, mb) for mb in batch]).sum() / len(batch)

    def eval_loss(self, params: Params, held: list[Any]) -> float:
        """Mean squared error over every token of ``held`` (weighted by the sizes of its sets)."""
        leaves = self.bind(params)
        with torch.no_grad():
            total = sum(float(self.row_loss(leaves, mb)) * len(mb[1]) for mb in held)
        return total / sum(len(mb[1]) for mb in held)

    def tokens(self, mb: Any) -> int:
        return len(mb[1])

    def stale_after(self, grads: Params, rank: int, cfg: Config) -> torch.Tensor | None:
        return grads[HEAD].clone() if rank != cfg.owner else None  # a replica never clears its copy


def make(name: str) -> Case:
    """The case called ``name`` (``"tokens"`` or ``"moe"``).

    >>> make("tokens").approaches[0].name
    'gradagg'
    """
    return TokenCase() if name == "tokens" else MoeCase()
