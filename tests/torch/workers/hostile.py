"""Rank workers for hostile training input (issue 16): each case ends in one GradaggError on every rank, or exact.

Every case returns ``(error class, message)`` or None per rank, so the test can check that every rank raised
the same kind of error, quickly (the world's collective timeout is short: a rank left waiting would show as
a CollectiveError naming a timeout instead).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.pure import PureAccumulator
from tests.torch.workers.dist import error_of


def seeded(seed: int, n: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype).requires_grad_()


def one_window(acc: Any, params: list[torch.Tensor], weights: list[object]) -> None:
    """Microbatch k's loss is sum_j (k + 1) * (j + 1) * sum(p_j): gradient (k + 1) * (j + 1) on parameter j."""
    for k, weight in enumerate(weights):
        with acc.microbatch(weight=weight):
            sum((k + 1) * (j + 1) * p.sum() for j, p in enumerate(params)).backward()  # type: ignore[union-attr]
    acc.finish()


def reordered() -> Any:
    """Bare tensors a, b (equal shapes, other values) given as [a, b] on rank 0 and [b, a] on rank 1."""
    a, b = seeded(1), seeded(2)
    params = [a, b] if dist.get_rank() == 0 else [b, a]
    return error_of(lambda: one_window(MicrobatchAccumulator(params), params, [None]))


def twins() -> Any:
    """Two bare zero tensors of one shape, in the same order on both ranks: nothing could tell a reordering."""
    params = [torch.zeros(3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    return error_of(lambda: one_window(MicrobatchAccumulator(params), params, [None]))


def big_weight(weight: float, dtype: torch.dtype) -> Any:
    """weight=``weight`` in each of 2 microbatches on each rank of a ``dtype`` model: D = 4 * weight."""
    params = [seeded(3, dtype=dtype), seeded(4, dtype=dtype)]
    acc = MicrobatchAccumulator([(f"p{j}", p) for j, p in enumerate(params)])
    err = error_of(lambda: one_window(acc, params, [weight, weight]))
    return err if err is not None else [p.grad.double() for p in params]  # type: ignore[union-attr]


def weights_on_rank(mine: list[object], other: list[object]) -> Any:
    """Rank 0 weights its microbatches ``mine``, rank 1 ``other``."""
    params = [seeded(5)]
    acc = MicrobatchAccumulator([("p", params[0])])
    return error_of(lambda: one_window(acc, params, mine if dist.get_rank() == 0 else other))


def meta_model() -> Any:
    return error_of(lambda: MicrobatchAccumulator(nn.Linear(2, 1, device="meta")))


def static_graph() -> Any:
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 1), static_graph=True)
    return error_of(lambda: MicrobatchAccumulator(ddp))


def set_between(rank_that_sets: int) -> Any:
    """One rank sets .grad by hand between its two microbatches: it counts in neither."""
    p = seeded(6)
    acc = MicrobatchAccumulator([("p", p)])

    def window() -> None:
        for k in range(2):
            with acc.microbatch():
                (p * (k + 1)).sum().backward()
            if k == 0 and dist.get_rank() == rank_that_sets:
                p.grad = torch.ones_like(p)
        acc.finish()

    return error_of(window)


def hand_set_inside(acc_kind: str) -> list[torch.Tensor | None]:
    """Inside microbatches: before a backward on ``a`` (autograd adds to it); on ``c``, which no backward reaches
    (rank 1 only; rank 0 never touches c). The fast accumulator and its twin must agree."""
    rank = dist.get_rank()
    a, c = seeded(7), seeded(8)
    acc: Any = MicrobatchAccumulator([("a", a), ("c", c)]) if acc_kind == "fast" else PureAccumulator([a, c])
    for k in range(2 + rank):
        with acc.microbatch():
            a.grad = torch.full_like(a, 10.0 * (k + 1))
            (a * (k + 1)).sum().backward()
            if rank == 1:
                c.grad = torch.full_like(c, float(k + 1))
    acc.finish()
    return [a.grad, c.grad]


def divisors_on_rank(mine: dict[str, object], other: dict[str, object]) -> Any:
    """Rank 0 counts its loss terms ``mine`` ahead, rank 1 ``other``."""
    acc = MicrobatchAccumulator([("p", seeded(9))])
    return error_of(lambda: acc.divisors(mine if dist.get_rank() == 0 else other))


def permuted(seed: int | None) -> tuple[bool, Any]:
    """Four bare tensors (three of one shape), rank 1 giving them in a seeded order (None: rank 0's): refused iff
    it is not rank 0's order."""
    tensors = [seeded(20 + k, n=3) for k in range(3)] + [seeded(30).reshape(3, 1).detach().requires_grad_()]
    order = [0, 1, 2, 3] if seed is None else torch.randperm(4, generator=torch.Generator().manual_seed(seed)).tolist()
    params = tensors if dist.get_rank() == 0 else [tensors[k] for k in order]
    return order != [0, 1, 2, 3], error_of(lambda: one_window(MicrobatchAccumulator(params), params, [None]))


def set_on_shard(mode: str) -> Any:
    """FSDP2, inside a microbatch, after its backward, rank 1 sets a .grad that no sum can take: window form, on
    the sharded parameter (what an optimizer holds); every_microbatch, on the unsharded one FSDP just reduced."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 2, bias=False), mesh=init_device_mesh("cpu", (2,)))
    shards = list(model.parameters())  # the DTensors, before any window unshards them
    acc = MicrobatchAccumulator(model, fsdp=mode)  # type: ignore[arg-type]

    def window() -> None:
        with acc.microbatch():
            model(torch.ones(1, 4)).sum().backward()
            if dist.get_rank() == 1:
                target = shards[0] if mode == "window" else acc.state.wrapper.held()[0]
                target.grad = torch.zeros_like(target)
        acc.finish()

    return error_of(window)


def hostile_world() -> dict[str, Any]:
    out: dict[str, Any] = {
        "reordered": reordered(),
        "twins": twins(),
        "weight_1e39_float32": big_weight(1e39, torch.float32),
        "weight_1e30_float32": big_weight(1e30, torch.float32),
        "weights_overflow_one_rank": weights_on_rank([1e308, 1e308], [1.0]),
        "weights_overflow_over_ranks": weights_on_rank([1e308], [1e308]),
        "huge_int_weight": weights_on_rank([10**400], [1.0]),
        "meta_weight": weights_on_rank([1.0], [torch.tensor(1.0, device="meta")]),
        "meta_model": meta_model(),
        "static_graph": static_graph(),
        "set_between": set_between(1),
        "inside_fast": hand_set_inside("fast"),
        "inside_pure": hand_set_inside("pure"),
        "divisors_invalid_one_rank": divisors_on_rank({"tokens": 4}, {"tokens": -1}),
        "set_on_shard": set_on_shard("window"),
        "set_after_fsdp_reduced": set_on_shard("every_microbatch"),
        "permutations": [permuted(None)] + [permuted(seed) for seed in range(8)],
    }
    return out
