"""Right, in float32: the token-mean example's step on a float32 copy of its model (default rtol 1e-3)."""

import _examples  # noqa: F401  (examples/parity on sys.path)
import _token_lm
from _token_lm import full_batch_loss, microbatches
from token_mean_by_hand import step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def build_model():
    return _token_lm.build_model().float()
