"""Right, under ``torch.autocast("cpu", dtype=torch.bfloat16)``: summed token loss, ``weight=`` its tokens (gradagg).

The error against the full batch (the same autocast) is bf16 round-off: judged at bf16's tolerance, it passes.
Its mistake twins: autocast_bf16_mean_of_means.py, autocast_bf16_mean_loss_with_weight.py.
"""

import _autocast
import torch
from _autocast import build_model
from _token_lm import microbatches, n_tokens

from gradagg.torch import MicrobatchAccumulator

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]
DTYPE = torch.bfloat16


def full_batch_loss(model: torch.nn.Module, window: list) -> torch.Tensor:
    return _autocast.full_batch_loss(model, DTYPE, window)


def weighted_step(model: torch.nn.Module, window: list, dtype: torch.dtype, reduction: str = "sum") -> None:
    acc = MicrobatchAccumulator(model)
    for mb in acc.microbatches(window):
        with acc.microbatch(weight=n_tokens(mb)):
            _autocast.token_loss(model, dtype, mb, reduction).backward()
    acc.finish()
    acc.close()


def step(model: torch.nn.Module, window: list) -> None:
    weighted_step(model, window, DTYPE)
