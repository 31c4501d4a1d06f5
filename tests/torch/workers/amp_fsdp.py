"""Rank workers: the accumulator on an FSDP2 model (``fully_shard``, both forms) under ``torch.autocast`` bf16 and
fp16 with a GradScaler: the loop, data and truth of :mod:`tests.torch.workers.amp`, on 2 ranks of one shard mesh.

The parameters stay float32 DTensors (no ``MixedPrecisionPolicy``: autocast alone lowers the compute), so after
``finish()`` each rank holds its float32 shard of the window's gradient. GradScaler's ``unscale_`` checks the
gradients it is given for inf and NaN: a rank's own shard only. One window overflows on rank 1 (its loss blown up
past fp16's range, so every element of its gradient is non-finite): FSDP's reduce-scatter puts that in both
ranks' shards, and each rank's scaler skips the step and halves its scale. Where the non-finite elements land in
one rank's shard only, the ranks must still agree: torch's GradScaler checks DTensor gradients through DTensor's
dispatch (its found-inf flag comes back reduced over the mesh), FSDP's ``ShardedGradScaler`` all-reduces its flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import amp


def _sharded(mode: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = amp._model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: nn.Module) -> nn.Module:
    """A plain twin holding ``model``'s full parameters (a collective: every rank calls it)."""
    twin = amp._model()
    twin.load_state_dict({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()})
    return twin


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.full_tensor().double() for n, p in model.named_parameters()}


def amp_fsdp_world(mode: str, cases: list[tuple[str, bool, str, str, str]]) -> list[list[dict[str, Any]]]:
    """Each case ``(precision, scaled, scaler_kind, overflow, attached)`` of :func:`amp_fsdp_case` in turn, a model
    each; a
    case that raised gives ``[{"raised": its message}]`` (the test names it) and ends the world's cases."""
    out: list[list[dict[str, Any]]] = []
    for case in cases:
        try:
            out.append(amp_fsdp_case(mode, *case))
        except Exception as exc:  # the test fails naming it; a peer may now wait in a collective: stop here
            return out + [[{"raised": f"{type(exc).__name__}: {exc}"}]] * (len(cases) - len(out))
    return out


def amp_fsdp_case(mode: str, precision: str, scaled: bool, scaler_kind: str = "torch", overflow: str = "whole",
                  attached: str = "") -> list[dict[str, Any]]:
    """Per window, as :func:`amp.amp_world`: the unscaled gradient's error against the float64 truth, whether the
    step ran on this rank, its scale, the usual recipe's error; and whether this rank's shard was finite.

    ``scaler_kind``: ``"torch"`` (``torch.amp.GradScaler``) or ``"sharded"`` (FSDP's ``ShardedGradScaler``, which
    all-reduces what it found over the ranks). ``overflow``: ``"whole"`` (rank 1's loss blown up in window 2: every
    element non-finite) or ``"shard"`` (rank 1's backward in window 2 non-finite in the first layer's first 8 hidden
    units only: after the reduce-scatter, in rank 0's shard alone). ``attached``: ``""`` (not), ``"microbatches"``
    (``acc.attach(opt)``, no ``finish()`` call: ``scaler.unscale_`` finishes the window first) or ``"loop"`` (the
    same with a plain ``for`` loop over the microbatches instead of ``acc.microbatches()``)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    rank = dist.get_rank()
    model = _sharded(mode)
    acc = MicrobatchAccumulator(model, fsdp=mode)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if attached:
        acc.attach(opt)
    kind = ShardedGradScaler if scaler_kind == "sharded" else torch.amp.GradScaler
    scaler = kind("cpu", init_scale=2.0**12) if scaled else None
    out = []
    for window in range(len(amp.COUNTS)):
        twin = _full(model)
        want = amp._truth(twin, window)
        blow = scaled and (window, rank) == amp.OVERFLOW
        mine = amp._mine(window, rank)
        for x in mine if attached == "loop" else acc.microbatches(mine):
            with acc.microbatch(weight=len(x)):
                with torch.autocast("cpu", dtype=amp.DTYPES[precision]), _shard_overflow(model, blow and
                                                                                        overflow == "shard"):
                    loss = amp._loss(model, x)
                if blow and overflow == "whole":
                    loss = loss * 1e30  # past fp16's range once the backward runs in fp16: a real overflow
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if not attached:
            acc.finish()
        if scaler is not None:
            scaler.unscale_(opt)
        mine_finite = all(bool(p.grad.to_local().isfinite().all()) for p in model.parameters() if p.grad is not None)
        got = _grads(model)
        finite = all(g is None or bool(g.isfinite().all()) for g in got.values())
        amp.step(opt, scaler)
        after = _full(model)
        out.append({
            "error": amp._relative(got, want) if finite else float("nan"),
            "finite": finite, "mine_finite": mine_finite,
            "stepped": any(not torch.equal(a, b) for a, b in zip(twin.parameters(), after.parameters())),
            "scale": None if scaler is None else float(scaler.get_scale()),
            "naive": amp._naive_relative(twin, window),
        })
    acc.close()
    return out


@contextlib.contextmanager
def _shard_overflow(model: nn.Module, on: bool) -> Iterator[None]:
    """While ``on``: the first layer's output gradient made infinite in hidden units 0-7 (of 16), so only those rows
    of its weight and bias gradients are non-finite: with FSDP2's dim-0 shards on 2 ranks, rank 0's alone."""
    if not on:
        yield
        return

    def blow(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        factor = torch.ones(output.shape[-1], dtype=output.dtype)
        factor[:8] = float("inf")
        output.register_hook(lambda g: g * factor)

    handle = model[0].register_forward_hook(blow)
    try:
        yield
    finally:
        handle.remove()
