"""Rank workers: the accumulator under ``torch.autocast`` (bf16, fp16) and fp16 with ``torch.amp.GradScaler``.

float32 parameters, the forward autocast to bf16 or fp16; per window each rank runs its share of seeded
microbatches (uneven, 0 included), each loss SUMMED over its rows and weighted by them. With a scaler:
``scaler.scale(loss).backward()`` in the microbatch, ``finish()``, ``scaler.unscale_``, a clip, ``scaler.step``,
``scaler.update``. One window overflows on purpose on one rank (its loss blown up past fp16's range once scaled):
the non-finite sum reaches every rank, GradScaler skips the step everywhere and halves its scale. Each window's
unscaled gradient is compared with the float64 truth of the same parameters over every rank's microbatches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COUNTS = ([3, 0], [1, 2], [2, 1], [0, 2])  # microbatches per rank, per window; window 2 overflows on rank 1
OVERFLOW = (2, 1)  # (window, rank)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _batches(window: int) -> list[torch.Tensor]:
    """Every rank's microbatches of a window, in rank order: rows 1 to 5, seeded by the window."""
    g = torch.Generator().manual_seed(100 + window)
    n = sum(COUNTS[window])
    return [torch.randn(int(torch.randint(1, 6, (1,), generator=g)), 6, generator=g) for _ in range(n)]


def _mine(window: int, rank: int) -> list[torch.Tensor]:
    counts = COUNTS[window]
    start = sum(counts[:rank])
    return _batches(window)[start:start + counts[rank]]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).sum()  # summed over rows: weighted by them


def _truth(model: nn.Module, window: int) -> dict[str, torch.Tensor]:
    """float64, one process, no autocast: the mean over every row of the window, at the same parameters."""
    twin = _model().double()
    twin.load_state_dict({k: v.double() for k, v in _plain_state(model).items()})
    xs = torch.cat(_batches(window)).double()
    (twin(xs).pow(2).sum() / len(xs)).backward()
    return {n: p.grad.detach().clone() for n, p in twin.named_parameters()}  # type: ignore[union-attr]


def _plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {n: None if p.grad is None else p.grad.detach().double().clone() for n, p in inner.named_parameters()}


def _relative(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor]) -> float:
    num = sum(float((g - want[n]).pow(2).sum()) if g is not None else float(want[n].pow(2).sum())
              for n, g in got.items())
    den = sum(float(t.pow(2).sum()) for t in want.values())
    return (num / den) ** 0.5


def _naive_relative(model: nn.Module, window: int) -> float:
    """The usual recipe's error on the same window: each rank's mean loss over its own rows, averaged over ranks
    (DDP's average of per-rank means), here in float64 without autocast, so only the weighting differs."""
    twin = _model().double()
    twin.load_state_dict({k: v.double() for k, v in _plain_state(model).items()})
    counts = COUNTS[window]
    ranks = [torch.cat(_mine(window, r)).double() for r in range(len(counts)) if counts[r]]
    loss = sum(twin(x).pow(2).sum() / len(x) for x in ranks) / len(counts)
    loss.backward()  # type: ignore[union-attr]
    return _relative({n: p.grad for n, p in twin.named_parameters()}, _truth(model, window))


def amp_world(layout: str, precision: str, scaled: bool, attached: bool = False) -> list[dict[str, Any]]:
    """Per window: the relative error of the unscaled gradient, whether the step ran, the scale, the recipe's error.

    ``attached``: ``acc.attach(opt)`` and no ``finish()`` call: ``scaler.unscale_`` (or, without a scaler, the clip)
    finishes the window first."""
    rank = dist.get_rank()
    base = _model()
    model: nn.Module = nn.parallel.DistributedDataParallel(base) if layout == "ddp" else base
    acc = MicrobatchAccumulator(model)
    opt = torch.optim.SGD(base.parameters(), lr=0.05)
    if attached:
        acc.attach(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaled else None
    out = []
    for window in range(len(COUNTS)):
        before = _plain_state(model)
        want = _truth(model, window)
        for x in acc.microbatches(_mine(window, rank)):
            with acc.microbatch(weight=len(x)):
                with torch.autocast("cpu", dtype=DTYPES[precision]):
                    loss = _loss(model, x)
                if scaled and (window, rank) == OVERFLOW:
                    loss = loss * 1e30  # past fp16's range once the backward runs in fp16: a real overflow
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if not attached:
            acc.finish()
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(base.parameters(), 1e3)  # far above the norm: a clip that keeps it exact
        got = _grads(model)
        finite = all(g is None or bool(g.isfinite().all()) for g in got.values())
        step(opt, scaler)
        after = _plain_state(model)
        out.append({
            "error": _relative(got, want) if finite else float("nan"),
            "finite": finite,
            "stepped": any(not torch.equal(before[k], after[k]) for k in before),
            "scale": None if scaler is None else float(scaler.get_scale()),
            "naive": _naive_relative(model, window),
        })
    return out


def step(opt: torch.optim.Optimizer, scaler: Any) -> None:
    """The optimizer's step through the scaler when there is one (it skips a non-finite step), then zero_grad."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
