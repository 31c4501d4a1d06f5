"""Right, token_mean_gradagg.py's float64 step inside ``torch.autocast("cpu", dtype=torch.bfloat16)``, which casts no
float64 operation: the step still computes in float64 and must be judged at float64's tolerance."""

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
from _token_lm import build_model, full_batch_loss, microbatches
from token_mean_gradagg import step as float64_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model: torch.nn.Module, window: list) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):  # on, but autocast leaves float64 alone
        float64_step(model, window)
