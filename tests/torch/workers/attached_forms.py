"""Rank workers: an attached optimizer over every wrapper, in a plain ``for`` loop where a rank runs no microbatch.

The loop a framework owns: no ``finish()``, no ``acc.microbatches()``; the clip, then the step, finish the window.
A rank with no microbatch calls nothing of the accumulator before its clip, while the others may already wait in
a collective of the window's opening (FSDP2 unshards every module; the shards forms agree each microbatch's
round). The model and truth are :mod:`tests.torch.workers.fsdp1`'s (float64); the gradient is read back through
an SGD step of rate 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import fsdp1
from tests.torch.workers import train as tw

FORMS = ("plain", "ddp", "fsdp2 window", "fsdp2 shards", "fsdp1")
DTYPES = {"fsdp1": torch.float32}  # the others float64
WINDOWS = [[3, 0], [0, 2], [1, 1], [0, 0], [2, 1]]  # per rank; [0, 0]: no microbatch anywhere, refused (M = 0)


def wrapped(form: str) -> tuple[nn.Module, dict[str, Any]]:
    """The model as ``form`` wraps it, and the accumulator's keyword arguments."""
    model = fsdp1._model()
    if form == "ddp":
        return nn.parallel.DistributedDataParallel(model), {}
    if form.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, {"fsdp": form.split()[1]}
    if form == "fsdp1":  # float32: FSDP1's own clip takes no float64
        return fsdp1.wrap("FULL_SHARD", True, "nested", model=fsdp1._model(torch.float32)), {}
    return model, {}


def full(model: nn.Module, form: str) -> dict[str, torch.Tensor]:
    if form == "fsdp1":
        return fsdp1.full_params(model)
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2's DTensor parameters
        out[n.replace("module.", "", 1) if form == "ddp" else n] = t.detach().clone()
    return out


def stepped(model: nn.Module, form: str, opt: torch.optim.Optimizer, before: dict[str, torch.Tensor]
            ) -> dict[str, torch.Tensor]:
    """The gradient ``opt`` (SGD of rate 1) steps, read whole as ``before - after`` (exact in float64); the step is
    then undone and the gradients dropped, so that each window's truth starts from the initial weights."""
    opt.step()
    after = full(model, form)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad)
    model.zero_grad()
    return {n: before[n] - after[n] for n in before}


def attached_world(form: str) -> list[Any]:
    """Per window of :data:`WINDOWS`: the stepped gradient's error against the float64 truth (with the clip's norm
    against the truth's), or the error the window raised (the empty one)."""
    from gradagg.errors import GradaggError

    rank, out = dist.get_rank(), []
    model, kw = wrapped(form)
    acc = MicrobatchAccumulator(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc.attach(opt)
    data, start = tw.token_batches(20), 0
    for counts in WINDOWS:
        window = data[start : start + sum(counts)]
        start += sum(counts)
        for batch in tw.share(window, counts, rank):  # a plain loop: no look-ahead, no finish()
            with acc.microbatch(weight=int(batch[3].sum())):
                fsdp1.loss_sum(model, batch, DTYPES.get(form, torch.float64)).backward()
        try:
            clip = model.clip_grad_norm_ if form == "fsdp1" else (
                lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))
            norm = float(clip(1e9))  # type: ignore[operator]
            before = full(model, form)  # after the clip: inside the window FSDP's parameters are another form
            got = stepped(model, form, opt, before)
        except GradaggError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
            acc.discard()
            continue
        want = fsdp1.truth(window)
        want_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in want.values()])))
        out.append({"error": fsdp1.error(got, want), "norm": abs(norm - want_norm) / want_norm})
    acc.close()
    return out
