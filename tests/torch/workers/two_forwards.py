"""Rank workers: microbatches whose loss takes two forwards through the model, in the shards forms (FSDP2's
``fsdp="shards"``, FSDP1's), with uneven counts, so that a rank pads while another runs two forwards.

Each forward all-gathers the sharded parameters (and its backward reduce-scatters): a padding microbatch must
run as many as the real ones of its round, or the ranks' collectives pair wrongly. The model and the float64
truth are :mod:`tests.torch.workers.fsdp1`'s (two halves of a batch give the gradient of the whole); the gradient
is read back through an SGD step of rate 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import attached_forms, fsdp1
from tests.torch.workers import train as tw

FORMS = ("fsdp2 shards", "fsdp1")
# (counts per rank, microbatches() or a bare loop): rank 1 pads in the rounds rank 0 runs alone, and rank 0 in the
# last window
WINDOWS = [([3, 1], True), ([2, 0], False), ([1, 2], True), ([0, 2], False)]


def two_forward_loss(model: torch.nn.Module, batch: tw.TokenBatch, dtype: torch.dtype) -> torch.Tensor:
    """The microbatch's summed loss, from two forwards: its first rows, then the rest."""
    x, y, pos, mask = batch
    cut = max(1, x.shape[0] // 2)
    first = (x[:cut], y[:cut], pos[:cut], mask[:cut])
    second = (x[cut:], y[cut:], pos[cut:], mask[cut:])
    return fsdp1.loss_sum(model, first, dtype) + fsdp1.loss_sum(model, second, dtype)


def two_forwards_world(form: str) -> list[Any]:
    """Per window of :data:`WINDOWS`: the finished gradient's error against the float64 truth, the padding count."""
    rank, out = dist.get_rank(), []
    model, kw = attached_forms.wrapped(form)
    dtype = attached_forms.DTYPES.get(form, torch.float64)
    acc = MicrobatchAccumulator(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data, start = tw.token_batches(20), 0
    for counts, look in WINDOWS:
        window = data[start : start + sum(counts)]
        start += sum(counts)
        mine = tw.share(window, counts, rank)
        for batch in acc.microbatches(mine) if look else mine:
            with acc.microbatch(weight=int(batch[3].sum())):
                two_forward_loss(model, batch, dtype).backward()
        acc.finish()
        got = attached_forms.stepped(model, form, opt, attached_forms.full(model, form))
        out.append({"error": fsdp1.error(got, fsdp1.truth(window)), "padded": acc.state.padded_last})
    acc.close()
    return out
