"""A tiny float64 regression for the parity tests' fixture scripts: 4 microbatches of 1, 2, 3 and 4 samples.

``right_step`` is a correct distributed step (sum-reduced loss, global sample count, all-reduce, divide);
each fixture script breaks it in one way. The truth is the gradient of the mean of (model(x))^2 over
all 10 samples.
"""

import torch
import torch.distributed as dist

SIZES = (1, 2, 3, 4)  # samples per microbatch: unequal, so a mean of means differs from the mean


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1, bias=True).double()


def microbatches() -> list[torch.Tensor]:
    window, start = [], 1
    for size in SIZES:
        i = torch.arange(start, start + size, dtype=torch.float64)
        window.append(torch.stack([i, torch.ones_like(i), -i], dim=1) / 10)
        start += size
    return window


def sum_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).sum()


def full_batch_loss(model: torch.nn.Module, microbatches: list[torch.Tensor]) -> torch.Tensor:
    return (model(torch.cat(microbatches)) ** 2).mean()


def count_and_backward(model: torch.nn.Module, microbatches: list[torch.Tensor]) -> torch.Tensor:
    """Back-propagate each microbatch's summed loss; return the window's sample count, all-reduced."""
    count = torch.tensor(float(sum(len(x) for x in microbatches)), dtype=torch.float64)
    dist.all_reduce(count)
    for x in microbatches:
        sum_loss(model, x).backward()
    return count


def right_step(model: torch.nn.Module, microbatches: list[torch.Tensor]) -> None:
    count = count_and_backward(model, microbatches)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= count
