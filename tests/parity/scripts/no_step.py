"""Unusable: defines everything but step()."""

from _tiny import build_model, full_batch_loss, microbatches

__all__ = ["build_model", "full_batch_loss", "microbatches"]
