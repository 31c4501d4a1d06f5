"""Right, a float64 model whose loss casts the logits to float32 (as transformers' own loss does).

The parameters and their gradients are float64, but the cross-entropy runs in float32: the step's error against the
full batch is float32 round-off (~1e-7), not float64's. Its mistake twin: float32_loss_cast_mean_of_means.py.
"""

import _examples  # noqa: F401  (examples/parity on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _token_lm import IGNORE, VOCAB, all_reduce_grads, build_model, microbatches, n_tokens

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def cast_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    logits = model(inputs).reshape(-1, VOCAB).float()  # the cast: float64 logits, a float32 loss
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction=reduction)


def full_batch_loss(model: torch.nn.Module, window: list) -> torch.Tensor:
    return cast_loss(model, torch.cat([x for x, _ in window]), torch.cat([y for _, y in window]), "mean")


def step(model: torch.nn.Module, window: list) -> None:
    tokens = torch.tensor(float(sum(n_tokens(mb) for mb in window)), dtype=torch.float64)
    dist.all_reduce(tokens)
    for inputs, targets in window:
        cast_loss(model, inputs, targets, "sum").backward()
    all_reduce_grads(model)
    for p in model.parameters():
        p.grad /= tokens
