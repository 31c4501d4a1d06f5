"""The examples' token model in float32, its forward under ``torch.autocast("cpu", dtype)``: bf16 or fp16 compute.

Autocast leaves float64 alone, so the model is float32 (as people train it); the full batch runs under the same
autocast as the step, so both sides of the comparison compute in the low precision and differ by its round-off.
"""

from contextlib import AbstractContextManager, nullcontext

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
import torch.nn.functional as F
from _token_lm import IGNORE, VOCAB
from _token_lm import build_model as build_float64

__all__ = ["autocast", "build_model", "full_batch_loss", "token_loss"]


def autocast(dtype: torch.dtype) -> AbstractContextManager[None]:
    """CPU autocast to ``dtype``; none for float32 (the model's own precision, which autocast refuses)."""
    return nullcontext() if dtype == torch.float32 else torch.autocast("cpu", dtype=dtype)


def build_model() -> torch.nn.Module:
    return build_float64().float()


def token_loss(model: torch.nn.Module, dtype: torch.dtype, mb: tuple, reduction: str = "sum") -> torch.Tensor:
    inputs, targets = mb
    with autocast(dtype):
        logits = model(inputs).reshape(-1, VOCAB)
        return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction=reduction)


def full_batch_loss(model: torch.nn.Module, dtype: torch.dtype, window: list) -> torch.Tensor:
    whole = (torch.cat([x for x, _ in window]), torch.cat([y for _, y in window]))
    return token_loss(model, dtype, whole, "mean")
