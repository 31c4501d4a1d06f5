"""Wrong, the mistake the README warns about: each microbatch's MEAN loss given ``weight=n`` (divided twice)."""

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
from _token_lm import build_model, full_batch_loss, microbatches, n_tokens, token_loss

from gradagg.torch import MicrobatchAccumulator

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, microbatches: list) -> None:
    acc = MicrobatchAccumulator(model)
    for mb in acc.microbatches(microbatches):
        with acc.microbatch(weight=n_tokens(mb)):
            token_loss(model, mb, reduction="mean").backward()  # the mistake: weight= needs the summed loss
    acc.finish()
    acc.close()
