"""Wrong with uneven counts: FSDP2's no_sync recipe, a reduce-scatter in each rank's last microbatch only.

The arithmetic is right: summed losses, the global token count as the divisor, FSDP's division by the
world size turned off (``set_gradient_divide_factor(1.0)``, on every FSDP module: it does not recurse,
and on the root alone the gradients come out 0.5x). With equal counts each rank reduce-scatters once,
in its last backward, and `gradagg parity examples/parity/mistake_fsdp2_sync_last_microbatch.py
--layouts 8 4,4 1,7 0,8` passes 8 and 4,4. It fails 1,7: rank 0's only backward reduce-scatters while
rank 1's first one does not, so from there the two ranks' collectives no longer pair up and both time
out inside step() (parity's 10 s collective timeout; a real job waits out torch's 10 or 30 minutes). It
fails 0,8: rank 0 runs no backward at all and returns, and rank 1 loses it in its first all-gather.
Exit 1, on the default layouts (8, 4,4, 1,7) too.
"""

import torch
import torch.distributed as dist
from _token_lm import build_model, full_batch_loss, microbatches, n_tokens, shard_blocks_and_root, token_loss

__all__ = ["build_model", "full_batch_loss", "microbatches", "prepare", "step"]


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    for module in shard_blocks_and_root(model):
        module.set_gradient_divide_factor(1.0)  # per FSDP module (it does not recurse): a sum over the ranks
    return model


def step(model: torch.nn.Module, microbatches: list) -> None:
    tokens = torch.tensor(float(sum(n_tokens(mb) for mb in microbatches)), dtype=torch.float64)
    dist.all_reduce(tokens)  # the right divisor: every valid token of the window, on all ranks
    for k, mb in enumerate(microbatches):
        model.set_requires_gradient_sync(k == len(microbatches) - 1)  # reduce-scatter in the last backward only
        (token_loss(model, mb) / tokens).backward()
