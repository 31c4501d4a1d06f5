"""Right: the tiny regression's correct step; passes every layout."""

from _tiny import build_model, full_batch_loss, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]
step = right_step
