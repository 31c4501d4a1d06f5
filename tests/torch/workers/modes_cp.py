"""Context parallel by hand on 4 gloo ranks (dp x cp = 2 x 2): every sequence's tokens split over the 2 cp ranks.

Issue 23, item 4, on CPU. The model needs the whole sequence: a token's output is ``w . x_t`` plus
``tanh(mean over the sequence of u . x)``, the mean's partial sums all-reduced over the cp group with
:class:`SumOverGroup` (its backward sums the upstream gradients over the cp group, as ring attention's
does). Rank r is dp replica r // 2, cp rank r % 2. The accumulator runs over the whole world (dp x cp):
every rank's gradient is summed once, and with token weights each valid token is counted once, on the cp
rank that holds it. verl#5983's undercount (the token count summed over the dp group only, the gradients
over dp x cp) is computed beside it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.modes import Layout, Mode, aggregate, plan_window
from tests.torch.workers import modes as wm


class SumOverGroup(torch.autograd.Function):
    """all_reduce(sum) with a backward: the gradient of every rank's input is the sum of the outputs' gradients.

    Written with the public ``dist.all_reduce``: ``torch.distributed.nn.functional.all_reduce`` does the same but
    is deprecated in torch 2.13 in favour of a private module.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class Context(nn.Module):
    """out_t = w . x_t + tanh(sum over the whole sequence of u . x / its length): a token sees its sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Linear(wm.D, 1, bias=False, dtype=torch.float64)
        self.u = nn.Linear(wm.D, 1, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor, cp: Any = None) -> torch.Tensor:
        partial = torch.zeros(len(lengths), dtype=x.dtype).index_add(0, index, self.u(x).squeeze(-1))
        if cp is not None:  # the other cp rank holds the rest of each sequence
            partial = SumOverGroup.apply(partial, cp)
        return self.w(x).squeeze(-1) + torch.tanh(partial / lengths)[index]


def truth(mode: Mode, seqs: list[wm.Sequence]) -> torch.Tensor:
    """The float64 one-process full batch: every sequence whole; the mode written out (``wm._formula``)."""
    m = Context()
    losses = []
    for s in seqs:
        out = m(s.x, torch.zeros(len(s.y), dtype=torch.long), torch.tensor([float(len(s.y))], dtype=torch.float64))
        losses.append((out - s.y) ** 2)
    wm._formula(mode, seqs, losses).backward()
    return _grads(m)


def _grads(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()]).detach().clone()  # type: ignore[union-attr]


def _microbatches(seqs: list[wm.Sequence], counts: list[int], dp: int, cp: int) -> list[dict[str, Any]]:
    """Replica ``dp``'s microbatches (sequences dealt round-robin over all replicas' microbatches), as cp rank
    ``cp`` holds them: the first half of every sequence's tokens on cp rank 0, the rest on cp rank 1 (a 1-token
    sequence leaves cp rank 1 an empty piece), packed with cu_seqlens, one segment per sequence in one order."""
    total, start = sum(counts), sum(counts[:dp])
    out = []
    for k in range(start, start + counts[dp]):
        mine = seqs[k::total]
        cuts = [(0, len(s.y) // 2 or len(s.y)) if cp == 0 else (len(s.y) // 2 or len(s.y), len(s.y)) for s in mine]
        sizes = [b - a for a, b in cuts]
        cu = torch.tensor([0] + [sum(sizes[: i + 1]) for i in range(len(sizes))])
        out.append(
            {
                "x": torch.cat([s.x[a:b] for s, (a, b) in zip(mine, cuts)]),
                "y": torch.cat([s.y[a:b] for s, (a, b) in zip(mine, cuts)]),
                "index": torch.repeat_interleave(torch.arange(len(mine)), torch.tensor(sizes)),
                "lengths": torch.tensor([float(len(s.y)) for s in mine], dtype=torch.float64),
                "layout": Layout(
                    torch.cat([s.mask[a:b] for s, (a, b) in zip(mine, cuts)]),
                    cu_seqlens=cu,
                    seq_ids=[s.sid for s in mine],
                    group_ids=[s.group for s in mine],
                ),
            }
        )
    return out


def run_window(model: nn.Module, acc: MicrobatchAccumulator, mine: list[dict[str, Any]], mode: Mode, plan: Any,
               cp: Any) -> Any:
    """This rank's microbatches, each loss aggregated by ``mode`` (by ``plan``, or as the window runs) and
    back-propagated in its microbatch (the model summing its forward over the ``cp`` group); the ledger."""
    for k, mb in enumerate(mine):
        lay = mb["layout"]
        loss = (model(mb["x"], mb["index"], mb["lengths"], cp) - mb["y"]) ** 2
        if plan is not None:
            part = aggregate(mode, loss, lay.mask, plan=plan, microbatch=k)
        else:
            part = aggregate(mode, loss, lay.mask, cu_seqlens=lay.cu_seqlens)
        with acc.microbatch(weight=part.weight):
            part.loss.backward()
    return acc.finish()


def cp_world(seed: int, counts: list[int]) -> dict[str, Any]:
    """Every mode, planned over the world (a sequence's pieces on both cp ranks share its id); token-mean also
    as you go (token weights, nothing counted ahead). Per case: (relative error, divisor, and for the token means
    the error of dividing by the tokens of this rank's dp group only, verl#5983's count)."""
    rank = dist.get_rank()
    dp, cp = divmod(rank, 2)
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
    seqs = wm.make_window(seed)
    mine = _microbatches(seqs, counts, dp, cp)
    out = {}
    # as you go: token-mean is exact (a token is on one rank); seq-mean-token-mean is not (each cp rank would
    # take its half of a sequence for the whole one, and count it once more): the plan is what makes it exact
    for mode, planned in [(m, True) for m in Mode] + [(Mode.TOKEN_MEAN, False), (Mode.SEQ_MEAN_TOKEN_MEAN, False)]:
        model = Context()
        acc = MicrobatchAccumulator(model)  # the whole world: dp x cp
        plan = plan_window(mode, [mb["layout"] for mb in mine], norm=wm._norm(mode)) if planned else None
        ledger = run_window(model, acc, mine, mode, plan, cp_groups[dp])
        if plan is not None:
            plan.check(ledger)
        want, got = truth(mode, seqs), _grads(model)
        assert ledger.weight_per_rank is not None and ledger.divisor is not None
        dp_only = sum(w for r, w in enumerate(ledger.weight_per_rank) if r % 2 == cp)  # this cp rank's dp group
        wrong = got * ledger.divisor / dp_only
        out[f"{mode.value} {'planned' if planned else 'as you go'}"] = (
            float((got - want).abs().max() / want.abs().max()),
            ledger.divisor,
            float((wrong - want).abs().max() / want.abs().max()) if mode == Mode.TOKEN_MEAN else None,
        )
        acc.close()
    return out
