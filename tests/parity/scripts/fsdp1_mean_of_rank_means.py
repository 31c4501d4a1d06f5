"""Wrong under FSDP1 on uneven token counts: each rank's mean loss, FSDP1 averaging over the ranks (its own
recipe, ``no_sync()`` between microbatches): a mean of the ranks' token means."""

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
from _token_lm import build_model, full_batch_loss, microbatches, n_tokens, token_loss
from fsdp1_token_mean import prepare

__all__ = ["build_model", "full_batch_loss", "microbatches", "prepare", "step"]


def step(model: torch.nn.Module, microbatches: list) -> None:
    tokens = sum(n_tokens(mb) for mb in microbatches)
    for k, mb in enumerate(microbatches):
        sync = k == len(microbatches) - 1
        with model.no_sync() if not sync else torch.enable_grad():
            (token_loss(model, mb) / tokens).backward()
