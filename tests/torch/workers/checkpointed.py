"""Rank workers: activation-checkpointed blocks under the accumulator (importable by the ranks).

Two ways of checkpointing :class:`tests.torch.workers.fsdp.Blocks` (float64): torch's ``checkpoint_wrapper``
around each block, as torchtitan's ``apply_ac`` does (the wrapper's ``named_parameters`` strips
``_checkpoint_wrapped_module.`` from the names, the root's keeps it), and ``torch.utils.checkpoint`` called in the
forward. Each under DDP (its defaults), FSDP2 ``fully_shard`` per block *after* wrapping and on the root (as
torchtitan does) in both forms, and torchtitan's ``full_dtensor`` layout; uneven token-weighted counts with a rank
running none, two windows. The reference is :class:`gradagg.torch.pure.PureAccumulator` on a plain replica.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import fsdp as fw
from tests.torch.workers import fsdp_uneven as fu
from tests.torch.workers import train as tw

PREFIX = "_checkpoint_wrapped_module."  # torch's _CHECKPOINT_PREFIX, which CheckpointWrapper's names drop
KINDS = ("checkpoint_wrapper", "torch.utils.checkpoint")
PARALLEL = ("ddp", "fsdp shards", "fsdp window", "full_dtensor")


class Recomputed(fw.Blocks):
    """Blocks whose every block runs under ``torch.utils.checkpoint`` (non-reentrant, torchtitan's choice)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(lambda t, b=block: torch.tanh(b(t)), x, use_reentrant=False)
        return self.head(x)


class Wrapped(fw.Blocks):
    """Blocks with each block inside ``checkpoint_wrapper`` (a public function of a private-named module; what
    torchtitan's ``apply_ac`` calls)."""

    def __init__(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        super().__init__(torch.float64)
        self.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in self.blocks)


def build(kind: str, parallel: str, mesh: Any) -> tuple[nn.Module, MicrobatchAccumulator]:
    model: nn.Module = Wrapped() if kind == "checkpoint_wrapper" else Recomputed(torch.float64)
    if parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        return model, MicrobatchAccumulator(model)
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import distribute_module

    options: dict[str, Any] = {"mesh": mesh}
    if parallel == "full_dtensor":  # torchtitan's full_dtensor backend: Replicate() parameters first
        model = distribute_module(model, mesh)
        options["dp_mesh_dims"] = DataParallelMeshDims(shard="dp_shard")
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **options)  # the CheckpointWrapper itself, as torchtitan's apply_fsdp after apply_ac
    fully_shard(model, **options)
    return model, MicrobatchAccumulator(model, fsdp="window" if parallel == "fsdp window" else "shards")


def _loss(model: nn.Module, batch: tw.TokenBatch, parallel: str) -> torch.Tensor:
    if parallel != "full_dtensor":
        return fu.loss64(model, batch)
    from torch.distributed.tensor import DTensor, Shard

    mesh = next(iter(model.parameters())).device_mesh  # type: ignore[attr-defined]
    x, y, _, mask = batch
    x, y, weight = (DTensor.from_local(t, mesh, [Shard(0)]) for t in (x, y, mask.double().unsqueeze(-1)))
    return ((model(x) - y).pow(2) * weight).sum()


def checkpointed_world(windows: list[list[int]]) -> dict[str, Any]:
    """Per (kind, parallel): per window, the largest error against the slow twin and the parameters' names."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, out = dist.get_rank(), {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))  # one for all cases
    for kind in KINDS:
        for parallel in PARALLEL:
            try:
                model, acc = build(kind, parallel, mesh)
                errors = []
                for counts in windows:
                    data = tw.share(tw.token_batches(sum(counts)), counts, rank)
                    for batch in acc.microbatches(data):
                        with acc.microbatch(weight=int(batch[3].sum())):
                            _loss(model, batch, parallel).backward()
                    acc.finish()
                    got = {n.replace(PREFIX, "").removeprefix("module."): g for n, g in fw.full_grads(model).items()}
                    want = fu.pure(counts, rank)
                    if got.keys() != want.keys():
                        raise AssertionError(f"names {sorted(got)} != {sorted(want)}")
                    errors.append(max(float((got[n] - want[n]).abs().max()) for n in want))
                    model.zero_grad(set_to_none=True)
                acc.close()
                out[f"{kind}, {parallel}"] = {"errors": errors}
            except Exception as exc:  # reported per case: one failing layout must not hide the others
                out[f"{kind}, {parallel}"] = {"raised": f"{type(exc).__name__}: {exc}"}
    return out
