"""Wrong, in float32: the mean of per-rank token means on a float32 copy of the example's model."""

import _examples  # noqa: F401  (examples/parity on sys.path)
from _token_lm import full_batch_loss, microbatches
from float32_by_hand import build_model
from mistake_mean_of_rank_means import step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]
