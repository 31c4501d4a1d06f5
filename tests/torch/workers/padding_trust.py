"""Rank workers for the shards form's padding against a hostile user (issue 22), on 2 or 3 gloo ranks.

The model, :class:`Stateful`, changes buffers of several kinds in its forward: a counter added to in place, a
counter reassigned (and used by the forward, so a wrong count moves the next window's gradients), BatchNorm's
running statistics and ``num_batches_tracked``, and a non-persistent buffer reassigned with the last activation.
``fully_shard`` on each block and the root, float64. The one-process truth keeps one plain replica per rank:
replica r runs rank r's microbatches in order (its buffers are what rank r's must be), and the gradients are
the sum over every replica's microbatches / D.
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
from tests.torch.workers import train as tw
from tests.torch.workers.dist import D_IN

SEED = 22


class Counting(nn.Module):
    """Linear -> BatchNorm -> scaled by its own call count -> tanh; counts rows in place, remembers the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(D_IN, D_IN), nn.BatchNorm1d(D_IN)
        self.register_buffer("rows", torch.zeros(()))  # a token counter, added to in place
        self.register_buffer("calls", torch.zeros(()))  # reassigned, and read by the forward
        self.register_buffer("last", torch.zeros(D_IN), persistent=False)  # reassigned with a new tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.shape[0]
        self.calls = self.calls + 1
        h = self.bn(self.lin(x)) * (1 + 0.01 * self.calls)
        self.last = h.detach().mean(0)
        return torch.tanh(h)


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in the truth
        self.blocks = nn.ModuleList(Counting() for _ in range(2))
        self.head = nn.Linear(D_IN, 1)
        self.double()

    def forward(self, x: torch.Tensor, act: Any = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if act is None else act(self.head(x))


def sharded(mesh: Any) -> Stateful:
    from torch.distributed.fsdp import fully_shard

    model = Stateful()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss64(model: nn.Module, batch: tw.TokenBatch) -> torch.Tensor:
    x, y, _, mask = batch
    return ((model(x) - y)[mask] ** 2).sum()


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def truth(plans: list[list[int]]) -> tuple[list[dict[str, torch.Tensor]], list[list[dict[str, torch.Tensor]]]]:
    """Per window, the gradients (sum over every rank's microbatches / D) and each rank's buffers after it."""
    ranks = len(plans[0])
    replicas = [Stateful() for _ in range(ranks)]
    grads, bufs = [], []
    for counts in plans:
        data, tokens = tw.token_batches(sum(counts)), 0
        for r, replica in enumerate(replicas):
            for batch in tw.share(data, counts, r):
                loss64(replica, batch).backward()
                tokens += int(batch[3].sum())
        grads.append({n: sum(rep.get_parameter(n).grad for rep in replicas if rep.get_parameter(n).grad is not None)
                      / tokens for n, _ in replicas[0].named_parameters()})
        bufs.append([buffers(rep) for rep in replicas])
        for rep in replicas:
            rep.zero_grad()
    return grads, bufs


def plans_for(ranks: int, windows: int, rng: random.Random) -> list[list[int]]:
    """Seeded counts 0..3 per rank, uneven in every window (so some rank pads), at least one microbatch."""
    out = []
    while len(out) < windows:
        counts = [rng.randint(0, 3) for _ in range(ranks)]
        if len(set(counts)) > 1:
            out.append(counts)
    return out


def buffers_world(windows: int) -> list[dict[str, Any]]:
    """For each style (microbatches(), bare calls, pad=fn), ``windows`` seeded uneven windows on one model: this
    rank's buffers and the full gradients after each, with the truth's."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, ranks = dist.get_rank(), dist.get_world_size()
    mesh, rng, out = init_device_mesh("cpu", (ranks,)), random.Random(SEED), []
    for style in ("microbatches", "bare", "pad=fn"):
        plans = plans_for(ranks, windows, rng)
        want_grads, want_bufs = truth(plans)
        model = sharded(mesh)
        pad_batch = tw.token_batches(5, seed=99)[4]
        pad = functools.partial(loss64, model, pad_batch) if style == "pad=fn" else "replay"
        acc = MicrobatchAccumulator(model, pad=pad)
        for k, counts in enumerate(plans):
            mine = tw.share(tw.token_batches(sum(counts)), counts, rank)
            for batch in acc.microbatches(mine) if style != "bare" else mine:
                with acc.microbatch(weight=int(batch[3].sum())):
                    loss64(model, batch).backward()
            acc.finish()
            got = fw.full_grads(model)
            out.append({"style": style, "counts": counts, "window": k, "padded": acc.state.padded_last,
                        "buffers": buffers(model), "want_buffers": want_bufs[k][rank],
                        "grad_error": max(float((got[n] - g).abs().max()) for n, g in want_grads[k].items())})
            model.zero_grad()
        acc.close()
    return out


def _raise(exc: Exception) -> Any:
    raise exc


# How rank 0's padding fails, and its microbatch counts (rank 0's, rank 1's). Each pad fn gets the model and
# a batch; None: pad="replay", with the forward given a lambda keyword argument (cannot be pickled).
FAILURES: dict[str, tuple[Any, list[int]]] = {
    "non-scalar loss": (lambda model, x: model(x), [1, 3]),
    "raises before the model": (lambda model, x: _raise(ValueError("no padding batch today")), [1, 3]),
    "raises after the forward": (lambda model, x: (model(x), _raise(KeyError("label")))[0], [1, 3]),
    "returns a float": (lambda model, x: 0.0, [1, 3]),
    "loss without a gradient": (lambda model, x: model(x).sum().detach(), [1, 3]),
    "part of the model": (lambda model, x: model.blocks[0](x).sum(), [1, 3]),
    "unpicklable replay": (None, [0, 2]),
}


def failure_case(mesh: Any, how: str, style: str) -> dict[str, Any]:
    """Rank 0's padding fails in way ``how`` (rank 1 pads with the replay); then an even window (2, 2)."""
    import time

    rank = dist.get_rank()
    fn, counts = FAILURES[how]
    model = sharded(mesh)
    x = tw.token_batches(5, seed=99)[4][0]
    pad = "replay" if fn is None or rank == 1 else functools.partial(fn, model, x)
    acc = MicrobatchAccumulator(model, pad=pad)
    act = (lambda t: t) if fn is None else None
    mine = tw.share(tw.token_batches(sum(counts)), counts, rank)
    start, error = time.monotonic(), None
    try:
        for batch in acc.microbatches(mine) if style == "microbatches" else mine:
            with acc.microbatch(weight=int(batch[3].sum())):
                xb, y, _, mask = batch
                ((model(xb, act=act) - y)[mask] ** 2).sum().backward()
        acc.finish()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the class: a raw error must show as one
        error = (type(exc).__name__, str(exc), time.monotonic() - start)
    dropped = all(p.grad is None for p in model.parameters())
    even = tw.share(tw.token_batches(4), [2, 2], rank)
    for batch in acc.microbatches(even):
        with acc.microbatch(weight=int(batch[3].sum())):
            loss64(model, batch).backward()
    after = acc.finish().divisor
    acc.close()
    return {"error": error, "dropped": dropped, "after": after}


def failure_world(cases: list[tuple[str, str]]) -> dict[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {case: failure_case(mesh, *case) for case in cases}


def unrecoverable_world(style: str) -> tuple[str, str, float] | None:
    """Rank 0 has no microbatch and a pad fn that raises before the model: nothing can complete the round in its
    place (no inputs of its own to replay). Rank 0 raises at once; rank 1 fails in FSDP's collectives."""
    import time

    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    model = sharded(init_device_mesh("cpu", (2,)))
    acc = MicrobatchAccumulator(model, pad=lambda: _raise(ValueError("no padding batch today")))
    mine = tw.share(tw.token_batches(2), [0, 2], rank)
    start = time.monotonic()
    try:
        for batch in acc.microbatches(mine) if style == "microbatches" else mine:
            with acc.microbatch(weight=int(batch[3].sum())):
                loss64(model, batch).backward()
        acc.finish()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the class: a raw error must show as one
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None
