"""Rank workers: a model wrapped after the accumulator was built, or the accumulator given the module inside a
wrapper the loop trains through (importable by the ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator

COUNTS = [1, 3]  # uneven: with the wrapper reducing on its own, gloo aborted the process (SIGABRT) before


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def _wrap(kind: str, model: nn.Module) -> nn.Module:
    cpu = torch.device("cpu")
    if kind == "DDP":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "FSDP1 orig":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, use_orig_params=True, device_id=cpu)
    if kind == "FSDP1 flat":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, use_orig_params=False, device_id=cpu)
    if kind == "DeepSpeed":
        import deepspeed

        from tests.integrations.workers.deepspeed_zero import launcher

        launcher()  # a launcher's variables, and no compiled shared-memory op
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
               "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
        return engine  # type: ignore[no-any-return]
    if kind == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)  # type: ignore[no-any-return]
    raise ValueError(kind)


def wrapped_world(kind: str, when: str) -> str:
    """``when``: "after" (the accumulator built on the model, then the model wrapped) or "inner" (wrapped first, the
    accumulator given the module inside). Uneven counts, through the wrapper: what the first rank's loop raised."""
    rank = dist.get_rank()
    model = _model()
    if when == "after":
        acc = MicrobatchAccumulator(model)
        wrapped = _wrap(kind, model)
    else:
        wrapped = _wrap(kind, model)
        inner: Any = wrapped.module if kind != "FSDP2" else wrapped
        if when == "inner unmarked":  # FSDP1's private mark gone: the fallback, the layout check's refusal
            for p in inner.parameters():
                p.__dict__.pop("_fsdp_flattened", None)
        try:
            acc = MicrobatchAccumulator(inner)
        except Exception as exc:  # the refusal under test
            return f"{type(exc).__name__}: {exc}"
    try:
        for _ in range(COUNTS[rank]):
            with acc.microbatch():
                wrapped(torch.randn(2, 4)).sum().backward()
        acc.finish()
    except Exception as exc:  # the refusal under test
        return f"{type(exc).__name__}: {exc}"
    return "finished"
