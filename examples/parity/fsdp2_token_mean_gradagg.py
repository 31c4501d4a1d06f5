"""Right under FSDP2 with any microbatch counts per rank: fully_shard, and gradagg counts the divisor.

``prepare`` shards the embedding, the output layer and the root (``fully_shard``): every parameter and,
after the step, every gradient is a DTensor shard. ``MicrobatchAccumulator(model)`` (``fsdp="window"``)
unshards every FSDP module once when the window opens, so forwards and backwards send nothing however
many microbatches a rank runs, none included; ``finish()`` reduce-scatters once and divides by D, the
window's 95 valid tokens, counted in the same collective.
`gradagg parity examples/parity/fsdp2_token_mean_gradagg.py --layouts 8 4,4 1,7 0,8` exits 0: every
layout passes, the one where rank 0 runs no microbatch included.
"""

import torch
from _token_lm import build_model, full_batch_loss, microbatches, n_tokens, shard_blocks_and_root, token_loss

from gradagg.torch import MicrobatchAccumulator

__all__ = ["build_model", "full_batch_loss", "microbatches", "prepare", "step"]


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    shard_blocks_and_root(model)
    return model


def step(model: torch.nn.Module, microbatches: list) -> None:
    acc = MicrobatchAccumulator(model)  # fsdp="window": uneven counts, zero included
    for mb in acc.microbatches(microbatches):  # marks the last one, so its backward already sends
        with acc.microbatch(weight=n_tokens(mb)):
            token_loss(model, mb).backward()  # the sum over tokens: the accumulator divides by D
    acc.finish()
    acc.close()
