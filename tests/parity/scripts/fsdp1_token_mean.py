"""Right under FSDP1 with any microbatch counts per rank: nested FullyShardedDataParallel units with
``use_orig_params=True`` (the HF Trainer's and Accelerate's default), and gradagg counting the divisor.

Each original parameter then holds, on each rank, a 1-d piece of its flattened self (empty on some ranks) and its
``.grad`` the same piece of the gradient: parity puts the ranks' pieces together in the checking process.
"""

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
from _token_lm import build_model, full_batch_loss, microbatches, n_tokens, token_loss

from gradagg.torch import MicrobatchAccumulator

__all__ = ["build_model", "full_batch_loss", "microbatches", "prepare", "step"]
USE_ORIG_PARAMS = True


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, use_orig_params=USE_ORIG_PARAMS, device_id=torch.device("cpu"),
                auto_wrap_policy=ModuleWrapPolicy({torch.nn.Embedding, torch.nn.Linear}))


def step(model: torch.nn.Module, microbatches: list) -> None:
    acc = MicrobatchAccumulator(model)  # FSDP1's shards form: uneven counts padded, zero included
    for mb in acc.microbatches(microbatches):
        with acc.microbatch(weight=n_tokens(mb)):
            token_loss(model, mb).backward()
    acc.finish()
    acc.close()
