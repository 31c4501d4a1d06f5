"""The approaches side by side: gradagg (the library, on a wrapped model) and the known wrong ones.

Every wrong approach is a function of what the ranks computed, gathered on every rank: for each
microbatch of each rank, the gradient of its *unscaled* loss (None where a parameter was absent) and
its number of valid tokens, and each rank's replica of ``head_b``'s gradient. It returns the gradient
that approach would step with; each is the arithmetic of code people ship, named in its docstring. The
two contracts' wrong fixes come from :mod:`gradagg.mutants` (defined once, also used by ``verify``); the
token-level ones are defined here, once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradagg import mutants
from gradagg.demo.data import valid_tokens
from gradagg.demo.models import HEAD, MoE, Params, TokenLM, moe_loss, token_loss
from gradagg.demo.options import Config
from gradagg.demo.results import GRADAGG, ApproachInfo
from gradagg.demo.wrap import full_grads, full_values, wrap
from gradagg.errors import WindowError
from gradagg.torch import MicrobatchAccumulator, Ownership, owner_reduce


@dataclass
class RankRows:
    """What one rank computed in one step, before any combination.

    Attributes:
        grads: one dict per microbatch: parameter name -> gradient of the unscaled loss, None = absent.
        tokens: valid tokens per microbatch (the MoE counts every token).
        stale: this rank's replica of ``head_b``'s gradient if it is not the owner (None before step 1).
    """

    grads: list[dict[str, torch.Tensor | None]]
    tokens: list[int]
    stale: torch.Tensor | None = None


Combine = Callable[[list[RankRows], Params, Config], Params]


def _weighted(ranks: list[RankRows], like: Params, coef: Callable[[int, int], float]) -> Params:
    """sum over ranks r and their microbatches i of coef(r, i) * g_ri; absent adds nothing."""
    out = {n: torch.zeros_like(t) for n, t in like.items()}
    for r, rank in enumerate(ranks):
        for i, row in enumerate(rank.grads):
            for n, g in row.items():
                if g is not None:
                    out[n] += coef(r, i) * g
    return out


def sum_over_m(ranks: list[RankRows], like: Params, cfg: Config) -> Params:
    """sum_i g_i / M: the right mean of microbatch means (the MoE); for summed token losses, "divide by M".

    >>> rows = [RankRows([{"w": torch.tensor(2.0)}], [1]), RankRows([{"w": None}, {"w": torch.tensor(4.0)}], [1, 1])]
    >>> sum_over_m(rows, {"w": torch.tensor(0.0)}, Config(steps=1, seed=0, counts=(1, 2)))
    {'w': tensor(2.)}
    """
    return _weighted(ranks, like, lambda r, i: 1.0 / cfg.m)


def mean_of_rank_means(ranks: list[RankRows], like: Params, cfg: Config) -> Params:
    """DDP with ``no_sync`` and ``loss / m_r``: (1/W) sum_r S_r / m_r. Right only when every m_r is equal."""
    return _weighted(ranks, like, lambda r, i: 1.0 / (cfg.world_size * cfg.counts[r]))


def divide_by_participation(ranks: list[RankRows], like: Params, cfg: Config) -> Params:
    """Each parameter's sum / the microbatches it was present in (:func:`gradagg.mutants.divide_by_participation`)."""
    names = list(like)
    rows = [[row[n] for n in names] for rank in ranks for row in rank.grads]
    means = mutants.divide_by_participation(rows)  # tensors in, tensors out: the mutant only adds and divides
    return {n: torch.as_tensor(v, dtype=like[n].dtype).expand_as(like[n]).clone() for n, v in zip(names, means)}


def _head_rows(ranks: list[RankRows], fresh: torch.Tensor, owner: int) -> list[list[object]]:
    """Owner-sum rows ``[shard, worker, owner, gradient]`` of head_b: the owner's fresh copy, the others' stale."""
    copies = [(r, fresh if r == owner else rank.stale) for r, rank in enumerate(ranks)]
    return [[HEAD, r, owner, copy] for r, copy in copies if copy is not None]


def sum_every_replica(ranks: list[RankRows], like: Params, cfg: Config) -> Params:
    """The right mean, except head_b: every rank's copy added (:func:`gradagg.mutants.sum_every_replica`)."""
    grads = sum_over_m(ranks, like, cfg)
    [[_, total]] = mutants.sum_every_replica(_head_rows(ranks, grads[HEAD], cfg.owner))
    grads[HEAD] = total  # type: ignore[assignment]
    return grads


def first_replica(ranks: list[RankRows], like: Params, cfg: Config) -> Params:
    """The right mean, except head_b: rank 0's copy, a stale replica (:func:`gradagg.mutants.first_replica`)."""
    grads = sum_over_m(ranks, like, cfg)
    [[_, kept]] = mutants.first_replica(_head_rows(ranks, grads[HEAD], cfg.owner))
    grads[HEAD] = kept  # type: ignore[assignment]
    return grads


def mean_of_token_means(ranks: list[RankRows], like: Params, cfg: Config) -> Params:
    """``cross_entropy(..., reduction="mean") / M`` per microbatch: (1/M) sum_i g_i / n_i.

    A microbatch of 3 tokens weighs as much as one of 16: right only when every microbatch has as many
    valid tokens (the transformers gradient-accumulation bug, #34191).
    """
    return _weighted(ranks, like, lambda r, i: 1.0 / (cfg.m * ranks[r].tokens[i]))


def local_tokens_times_world(ranks: list[RankRows], like: Params, cfg: Config) -> Params:
    """Each rank divides its summed loss by its own token count N_r, then DDP averages over W: (1/W) sum_r S_r / N_r.

    The divisor N_r * W assumes every rank holds as many tokens as this one: right only when they do.
    """
    return _weighted(ranks, like, lambda r, i: 1.0 / (cfg.world_size * sum(ranks[r].tokens)))


MOE_APPROACHES = (
    ApproachInfo(GRADAGG, "gradagg", f"sum over all microbatches of all ranks / counted M; {HEAD} from its owner only"),
    ApproachInfo("divide by participation", "particip.",
                 "each parameter / microbatches it was present in: an absent expert's zeros dropped"),
    ApproachInfo("DDP (W x m_r)", "DDP W*m_r", "each rank's mean over its m_r, then the mean over ranks: right only "
                 "for equal counts"),
    ApproachInfo("sum every replica", "sum repl.", f"{HEAD}'s copies added over ranks: the stale replicas count"),
    ApproachInfo("first replica", "first repl.", f"{HEAD} taken from rank 0: a stale non-owner copy"),
)
TOKEN_APPROACHES = (
    ApproachInfo(GRADAGG, "gradagg", "weight = valid tokens: summed losses / D, D = every valid token of all ranks"),
    ApproachInfo("mean of token means", "tok. means",
                 "each microbatch's token mean / M: a short microbatch weighs as much as a long one"),
    ApproachInfo("local tokens x W", "local*W",
                 "each rank / (its own tokens N_r x W): right only if all N_r are equal"),
    ApproachInfo("divide by M", "divide M", "summed losses / M (weight= forgotten): x N/M, a factor that changes "
                 "every step"),
)
WRONG: dict[str, Combine] = {
    "divide by participation": divide_by_participation,
    "DDP (W x m_r)": mean_of_rank_means,
    "sum every replica": sum_every_replica,
    "first replica": first_replica,
    "mean of token means": mean_of_token_means,
    "local tokens x W": local_tokens_times_world,
    "divide by M": sum_over_m,
}


class GradaggRun(ABC):
    """gradagg's own model copy, wrapped as ``--wrap`` says, trained through the library's public API.

    Args:
        module: the plain model with its initial values.
        cfg: the configuration (``cfg.wrap``).
        lr: the SGD learning rate.
        extra: parameters outside the module (the MoE's ``head_b``), stepped by the same optimizer.
    """

    def __init__(self, module: MoE | TokenLM, cfg: Config, lr: float, extra: list[torch.Tensor] | None = None):
        self.model = wrap(module, cfg.wrap, module.shard_units())
        # the window form: the MoE's experts run only where a token chose them, so FSDP2's per-expert collectives
        # differ between ranks (the shards form needs every rank to reach the same FSDP modules)
        self.acc = MicrobatchAccumulator(self.model, fsdp="window")
        self.params, self.lr = [*self.model.parameters(), *(extra or [])], lr
        self.ledger = ""  # the first window's ledger, as text

    @abstractmethod
    def step(self, mine: list[Any]) -> Params:
        """Accumulate this rank's microbatches ``mine`` through the library; return the full gradients."""

    def values(self) -> Params:
        """The full parameter values (a collective under FSDP2)."""
        return full_values(self.model)

    def grads(self) -> Params:
        """The full gradients after :meth:`MicrobatchAccumulator.finish` (a collective under FSDP2)."""
        return full_grads(self.model)

    def update(self) -> None:
        """One plain SGD step, then the model's gradients back to None, as the next window requires.

        By hand rather than ``torch.optim.SGD``, whose first step imports ``torch._dynamo`` in every rank
        (slower than the whole training); the same update, and on DTensors under FSDP2 as well.
        """
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.sub_(self.lr * p.grad)
        self.model.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Detach the accumulator (gives DDP and FSDP2 their own synchronisation back)."""
        self.acc.close()


class TokenGradagg(GradaggRun):
    """Each microbatch back-propagates its *summed* token loss with ``weight=`` its valid tokens."""

    def step(self, mine: list[Any]) -> Params:
        """Accumulate this rank's microbatches; return the full gradients, divided by the global token count."""
        for inputs, targets in self.acc.microbatches(mine):  # marks the last: its backward already sends
            with self.acc.microbatch(weight=valid_tokens(targets)):
                token_loss(self.model(inputs), targets).backward()  # type: ignore[no-untyped-call]
        ledger = self.acc.finish()
        self.ledger = self.ledger or ledger.report()
        return self.grads()


class MoeGradagg(GradaggRun):
    """The trunk through the accumulator (``D = M``); ``head_b`` through :func:`~gradagg.torch.owner_reduce`.

    ``head_b`` stays out of the accumulator: only its owner's data use it, so it travels through the
    distributed owner-sum, divided by the accumulator's counted M. Only the owner clears its gradient (as a
    ZeRO-1 optimizer zeroes only its own partition), so another rank's ``head_b.grad`` is last step's: a
    stale replica, which it passes to ``owner_reduce`` and which is never counted.
    """

    def __init__(self, module: MoE, head: torch.Tensor, cfg: Config, lr: float, rank: int):
        self.head = head.detach().clone().requires_grad_()
        super().__init__(module, cfg, lr, extra=[self.head])
        self.owns_head = rank == cfg.owner
        self.ownership = Ownership.from_tensors({HEAD: self.head}, owners={HEAD: cfg.owner})

    def values(self) -> Params:
        return {**super().values(), HEAD: self.head.detach()}

    def step(self, mine: list[Any]) -> Params:
        """Accumulate this rank's microbatches; return the full gradients of the trunk and head_b."""
        if self.owns_head:
            self.head.grad = None  # zero_grad on the owner only: a replica keeps last step's gradient
        for mb in self.acc.microbatches(mine):
            with self.acc.microbatch():
                moe_loss(self.model, self.head, mb).backward()  # type: ignore[no-untyped-call]  # unscaled
        ledger = self.acc.finish()
        self.ledger = self.ledger or ledger.report()
        if self.owns_head and self.head.grad is not None:
            if ledger.divisor is None:  # finish() always counts M; never guess a divisor
                raise WindowError("the accumulator finished without a microbatch count")
            self.head.grad.div_(ledger.divisor)  # the sum over the owner's microbatches -> its share of the mean
        held = {HEAD: self.head.grad} if self.head.grad is not None else {}  # on a replica: stale, ignored
        self.head.grad = owner_reduce(held, self.ownership).get(HEAD)
        return {**self.grads(), HEAD: torch.zeros_like(self.head) if self.head.grad is None else self.head.grad}
