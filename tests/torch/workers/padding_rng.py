"""Rank workers: a padding microbatch leaves nothing the next real one sees (issue 30), on 2 gloo ranks.

The model, :class:`Noisy`, draws from the RNG (dropout) and keeps plain Python attributes its forward changes:
an ``int`` counter rebound at every call and read by the forward (a wrong count moves the gradients), a list it
appends to, a dict it writes into, and a plain tensor attribute and a plain DTensor one it adds to in place.
``fully_shard`` on each block and the root, float64. Each rank seeds its RNG with ``SEED + rank`` after building
the model.

The one-process truth keeps one plain replica per rank with its own RNG stream (the state saved and put back
around each replica's microbatches): replica r runs only rank r's real microbatches, in order, so what it draws,
counts and appends is what rank r's model must show; the gradients are the sum over every replica's microbatches
/ D. A padding microbatch that drew from the RNG or counted would shift every later real microbatch of its rank.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import fsdp as fw
from tests.torch.workers import padding_trust as pt
from tests.torch.workers import train as tw
from tests.torch.workers.dist import D_IN

SEED = 30


class Dropping(nn.Module):
    """Linear -> dropout -> scaled by its own call count -> tanh; logs its calls in a list, a dict and a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(D_IN, D_IN), nn.Dropout(0.5)
        self.calls = 0  # a plain int, rebound at every call
        self.seen: list[int] = []  # appended to
        self.rows: dict[str, int] = {}  # written into
        self.total = torch.zeros(())  # a plain tensor attribute (no buffer), added to in place
        self.spread: Any = torch.zeros(2)  # a DTensor (Replicate) on the sharded model: put back without a collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(x.shape[0])
        self.rows["last"] = x.shape[0]
        self.total += x.shape[0]
        self.spread.add_(x.shape[0])
        return torch.tanh(self.drop(self.lin(x)) * (1 + 0.01 * self.calls))


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in the truth
        self.blocks = nn.ModuleList(Dropping() for _ in range(2))
        self.head = nn.Linear(D_IN, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def sharded(mesh: Any) -> Noisy:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = Noisy()
    for block in model.blocks:
        block.spread = distribute_tensor(torch.zeros(2), mesh, [Replicate()])
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def attributes(model: nn.Module) -> list[Any]:
    """What each block's forward changed: its count, its list, its dict, its tensors' values."""
    local = [getattr(b.spread, "to_local", lambda s=b.spread: s)() for b in model.blocks]  # type: ignore[union-attr]
    return [(b.calls, list(b.seen), dict(b.rows), float(b.total), local[k].tolist())  # type: ignore[union-attr]
            for k, b in enumerate(model.blocks)]


def truth(plans: list[list[int]]) -> tuple[list[dict[str, torch.Tensor]], list[list[list[Any]]]]:
    """Per window, the gradients (sum over every rank's microbatches / D) and each replica's attributes after it."""
    ranks = len(plans[0])
    replicas = [Noisy() for _ in range(ranks)]
    streams = []
    for r in range(ranks):
        torch.manual_seed(SEED + r)
        streams.append(torch.get_rng_state())
    grads, attrs = [], []
    for counts in plans:
        data, tokens = tw.token_batches(sum(counts)), 0
        for r, replica in enumerate(replicas):
            torch.set_rng_state(streams[r])
            for batch in tw.share(data, counts, r):
                pt.loss64(replica, batch).backward()
                tokens += int(batch[3].sum())
            streams[r] = torch.get_rng_state()
        grads.append({n: sum(rep.get_parameter(n).grad for rep in replicas if rep.get_parameter(n).grad is not None)
                      / tokens for n, _ in replicas[0].named_parameters()})
        attrs.append([attributes(rep) for rep in replicas])
        for rep in replicas:
            rep.zero_grad()
    return grads, attrs


def dropout_world(windows: int) -> list[dict[str, Any]]:
    """For each style (microbatches() with the replay, bare calls with pad=fn), ``windows`` seeded uneven windows on
    one model: the gradients' distance to the truth and this rank's attributes, with the truth's."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, ranks = dist.get_rank(), dist.get_world_size()
    mesh, rng, out = init_device_mesh("cpu", (ranks,)), random.Random(SEED), []
    for style in ("microbatches", "bare"):
        plans = pt.plans_for(ranks, windows, rng)
        want_grads, want_attrs = truth(plans)
        model = sharded(mesh)
        torch.manual_seed(SEED + rank)  # this rank's stream, as the truth's replica
        pad = "replay" if style == "microbatches" else functools.partial(pt.loss64, model, tw.token_batches(5, 99)[4])
        acc = MicrobatchAccumulator(model, pad=pad)
        for k, counts in enumerate(plans):
            mine = tw.share(tw.token_batches(sum(counts)), counts, rank)
            for batch in acc.microbatches(mine) if style == "microbatches" else mine:
                with acc.microbatch(weight=int(batch[3].sum())):
                    pt.loss64(model, batch).backward()
            acc.finish()
            got = fw.full_grads(model)
            out.append({"style": style, "counts": counts, "window": k, "padded": acc.state.padded_last,
                        "attributes": attributes(model), "want_attributes": want_attrs[k][rank],
                        "grad_error": max(float((got[n] - g).abs().max()) for n, g in want_grads[k].items())})
            model.zero_grad()
        acc.close()
    return out
