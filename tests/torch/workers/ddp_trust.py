"""Rank workers for DDP's own settings under the accumulator, and the accumulator's group (issue 22).

3 gloo ranks. Each case returns what the test compares against a float64 truth computed in the test: the
gradients (float64 lists), or ``(error class, message)`` where the case must be refused on every rank.

The model is ``Pair``: ``y = a * x + b * x`` with ``a`` and ``b`` of 3 elements, so that microbatch ``k`` of rank
``r`` (its input ``x = c(r, k)``, a scalar) gives gradient ``c(r, k)`` to every element of ``a`` and of ``b``, the
loss being ``sum(y)``; the truth of a mean is then a sum of those coefficients over a known set of microbatches
divided by a known count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradagg.errors import WindowError
from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers.dist import error_of

# microbatches per rank (rank 2 runs none in the first case that uses them)
COUNTS = (2, 3, 1)


def coef(rank: int, k: int) -> float:
    """The input of rank ``rank``'s microbatch ``k``: the gradient it gives to every parameter element."""
    return float(10 * rank + k + 1)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3, dtype=torch.float64))
        self.b = nn.Parameter(torch.zeros(3, dtype=torch.float64))
        self.register_buffer("seen", torch.zeros(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a * x + self.b * x


def _run(acc: MicrobatchAccumulator, model: nn.Module, weighted: bool = False) -> None:
    rank = dist.get_rank()
    for k in acc.microbatches(range(COUNTS[rank])):
        with acc.microbatch(weight=(k + 1) if weighted else None):
            model(torch.tensor(coef(rank, k), dtype=torch.float64)).sum().backward()
    acc.finish()


def _grads(module: nn.Module) -> dict[str, list[float] | None]:
    return {n: None if p.grad is None else p.grad.reshape(-1).tolist() for n, p in module.named_parameters()}


def subgroups() -> tuple[Any, Any]:
    """DDP's groups: ranks 0 and 1 together, rank 2 alone (every rank creates both, as torch requires)."""
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])
    return pair if dist.get_rank() < 2 else alone, pair


def ddp_subgroup() -> dict[str, Any]:
    """DDP on a subgroup, the accumulator given no group: it must reduce over DDP's group only."""
    mine, _ = subgroups()
    model = DDP(Pair(), process_group=mine)
    acc = MicrobatchAccumulator(model)
    _run(acc, model)
    acc.close()
    return _grads(model.module)


def ddp_subgroup_mismatch() -> Any:
    """DDP on a subgroup, the accumulator explicitly on the default group: refused at construction."""
    mine, _ = subgroups()
    model = DDP(Pair(), process_group=mine)
    return error_of(lambda: MicrobatchAccumulator(model, group=dist.group.WORLD))


def ddp_same_group_given() -> dict[str, Any]:
    """DDP on a subgroup and the accumulator given that same group: accepted, reduced over it."""
    mine, _ = subgroups()
    model = DDP(Pair(), process_group=mine)
    acc = MicrobatchAccumulator(model, group=mine)
    _run(acc, model)
    acc.close()
    return _grads(model.module)


def ddp_ignored(weighted: bool) -> dict[str, Any]:
    """``b`` in DDP's parameters_to_ignore: DDP keeps its gradient rank-local, so must the accumulator."""
    module = Pair()
    # the only way to fill DDP's parameters_to_ignore is this static method (a private name, used by
    # torch's own tests and by FSDP/DDP composites); gradagg itself only reads the public attribute
    DDP._set_params_and_buffers_to_ignore_for_model(module, ["b"])
    model = DDP(module)
    acc = MicrobatchAccumulator(model)
    _run(acc, model, weighted)
    ledger = acc.ledger
    acc.close()
    return {"grads": _grads(model.module), "report": ledger.report(), "rank_local": list(ledger.rank_local)}


def ddp_ignored_zero_weights() -> dict[str, Any]:
    """``b`` in DDP's parameters_to_ignore, rank 1's microbatches all of weight 0 (the others 1, 2, ...): rank 1 has
    nothing to divide its own sum of ``b`` by, so its ``b`` is absent (None), while ``a`` is the global mean."""
    module = Pair()
    DDP._set_params_and_buffers_to_ignore_for_model(module, ["b"])  # see ddp_ignored
    model = DDP(module)
    acc = MicrobatchAccumulator(model)
    rank = dist.get_rank()
    for k in acc.microbatches(range(COUNTS[rank])):
        with acc.microbatch(weight=0 if rank == 1 else k + 1):
            model(torch.tensor(coef(rank, k), dtype=torch.float64)).sum().backward()
    acc.finish()
    ledger = acc.ledger
    acc.close()
    return {"grads": _grads(model.module), "report": ledger.report(), "divisor": ledger.rank_local_divisor}


def ddp_ignored_tiny_count() -> tuple[str, str] | dict[str, Any]:
    """Rank 0's own total weight, 2e-39, is below float32's smallest normal: its rank-local ``b`` (float32) divided
    by it would be inf, though the global D (about 9) divides ``a`` well."""
    module = Pair().float()
    DDP._set_params_and_buffers_to_ignore_for_model(module, ["b"])  # see ddp_ignored
    model = DDP(module)
    acc = MicrobatchAccumulator(model)
    rank = dist.get_rank()
    try:
        for k in range(COUNTS[rank]):
            with acc.microbatch(weight=1e-39 if rank == 0 else k + 1):
                model(torch.tensor(coef(rank, k))).sum().backward()
        acc.finish()
    except WindowError as exc:
        acc.discard()
        acc.close()
        return ("WindowError", str(exc))
    acc.close()
    return _grads(model.module)


def ddp_buffer_changed(change: str) -> dict[str, Any]:
    """Rank 1 changes the dtype or the shape of a buffer DDP broadcasts, during the window: refused on every rank
    at finish(), before any buffer moves; after discard() and the buffer put back, the next window is exact."""
    model = DDP(Pair())
    acc = MicrobatchAccumulator(model)
    mod = model.module
    kept = mod.seen

    def window() -> None:
        if dist.get_rank() == 1:
            mod.seen = kept.float() if change == "dtype" else torch.zeros(3, dtype=torch.float64)
        _run(acc, model)

    error = error_of(window)
    again = error_of(acc.finish)  # still refused: the window stays failed until discard()
    acc.discard()
    mod.seen = kept
    _run(acc, model)
    acc.close()
    return {"error": error, "again": again, "after": _grads(mod)}


def outside_group() -> Any:
    """An accumulator on a group of ranks 0 and 1: rank 2 is not in it."""
    group = dist.new_group([0, 1])
    p = torch.zeros(2, requires_grad=True)
    return error_of(lambda: MicrobatchAccumulator([("p", p)], group=group))


def dtensor_weight(placement: str) -> Any:
    """A 0-dim DTensor as a microbatch weight: a replicated one counts its value; a partial one is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    place = Replicate() if placement == "replicate" else Partial()
    p = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])

    def window() -> None:
        w = DTensor.from_local(torch.tensor(2.0, dtype=torch.float64), mesh, [place])
        with acc.microbatch(weight=w):
            (p.sum() * (dist.get_rank() + 1)).backward()
        acc.finish()

    err = error_of(window)
    return err if err is not None else {"grad": p.grad.tolist(), "divisor": acc.ledger.divisor}  # type: ignore[union-attr]


# --- the class: DDP's groups, its ignored parameters and changing buffers, drawn from a seed -------------------

PARTITIONS = [[[0, 1, 2]], [[0, 1], [2]], [[0], [1, 2]], [[0, 2], [1]], [[0], [1], [2]]]
SHAPES = {"a": (3,), "b": (2, 2), "c": (1,)}


def plan(seed: int) -> dict[str, Any]:
    """One trial, the same on every rank and in the test's truth: DDP's groups, the ignored parameters, the
    microbatches (count, weight, whether each reaches ``c``), the accumulator's group, a buffer change."""
    import random

    rng = random.Random(seed)
    counts = [rng.randint(0, 3) for _ in range(3)]
    pl = {
        "parts": rng.choice(PARTITIONS),
        "ignored": sorted(rng.sample(sorted(SHAPES), rng.randint(0, 2))),
        "counts": counts,
        "weighted": rng.random() < 0.5,
        "weights": [[rng.randint(0, 3) for _ in range(n)] for n in counts],
        "uses_c": [[rng.random() < 0.6 for _ in range(n)] for n in counts],
        "group": rng.choice(["none", "none", "own", "world"]),
        "change": rng.choice([None, None, ("dtype", rng.randint(0, 2)), ("shape", rng.randint(0, 2))]),
    }
    # drawn last, so that the draws above are those of the seeds before it: a rank whose microbatches all weigh 0
    # (its rank-local divisor is 0: an ignored parameter's gradient is then absent)
    zero = rng.choice([None, None, 0, 1, 2])
    if zero is not None:
        pl["weights"][zero] = [0] * counts[zero]
    return pl


class Three(nn.Module):
    """``sum(a) x + 2 sum(b) x + 3 sum(c) x``: parameter j's gradient is (j + 1) x in every element."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            setattr(self, name, nn.Parameter(torch.zeros(shape, dtype=torch.float64)))
        self.register_buffer("seen", torch.zeros(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor, uses_c: bool) -> torch.Tensor:
        out = self.a.sum() * x + 2 * self.b.sum() * x
        return out + 3 * self.c.sum() * x if uses_c else out


def trial(seed: int) -> Any:
    """Run ``plan(seed)`` on this rank: its gradients, or ``(error class, message)``."""
    pl, rank = plan(seed), dist.get_rank()
    groups = [dist.new_group(part) for part in pl["parts"]]  # every rank creates every group, in one order
    own = next(g for g, part in zip(groups, pl["parts"]) if rank in part)
    module = Three()
    DDP._set_params_and_buffers_to_ignore_for_model(module, pl["ignored"])  # see ddp_ignored
    model = DDP(module, process_group=own)
    given = {"none": None, "own": own, "world": dist.group.WORLD}[pl["group"]]
    built: list[MicrobatchAccumulator] = []
    error = error_of(lambda: built.append(MicrobatchAccumulator(model, group=given)))
    if error is not None:
        return error
    acc = built[0]
    change = pl["change"]
    if change is not None and change[1] == rank:
        module.seen = module.seen.float() if change[0] == "dtype" else torch.zeros(3, dtype=torch.float64)

    def window() -> None:
        for k in acc.microbatches(range(pl["counts"][rank])):
            with acc.microbatch(weight=pl["weights"][rank][k] if pl["weighted"] else None):
                model(torch.tensor(coef(rank, k), dtype=torch.float64), pl["uses_c"][rank][k]).sum().backward()
        acc.finish()

    error = error_of(window)
    acc.close()
    return error if error is not None else _grads(module)


def fuzz_world(seeds: list[int]) -> list[Any]:
    return [trial(seed) for seed in seeds]


def no_warnings() -> str | None:
    """DDP with its defaults held, a window finished and released with every warning an error: None, or the first."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = DDP(Pair())
            acc = MicrobatchAccumulator(model)
            _run(acc, model)
            acc.close()
    except Warning as w:
        return f"{type(w).__name__}: {w}"
    return None


def trust_world() -> dict[str, Any]:
    return {
        "no_warnings": no_warnings(),
        "subgroup": ddp_subgroup(),
        "subgroup_mismatch": ddp_subgroup_mismatch(),
        "same_group_given": ddp_same_group_given(),
        "ignored": ddp_ignored(False),
        "ignored_weighted": ddp_ignored(True),
        "ignored_zero": ddp_ignored_zero_weights(),
        "ignored_tiny": ddp_ignored_tiny_count(),
        "buffer_dtype": ddp_buffer_changed("dtype"),
        "buffer_shape": ddp_buffer_changed("shape"),
        "outside_group": outside_group(),
        "dtensor_replicate": dtensor_weight("replicate"),
        "dtensor_partial": dtensor_weight("partial"),
    }
