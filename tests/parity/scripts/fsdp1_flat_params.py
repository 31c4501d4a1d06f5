"""FSDP1 with ``use_orig_params=False``: the gradients live in FSDP1's flat parameters, which parity cannot split
into the model's parameters without FSDP1's private layout; it says so, naming ``use_orig_params=True``."""

import fsdp1_token_mean
from fsdp1_token_mean import build_model, full_batch_loss, microbatches, prepare, step

__all__ = ["build_model", "full_batch_loss", "microbatches", "prepare", "step"]
fsdp1_token_mean.USE_ORIG_PARAMS = False
