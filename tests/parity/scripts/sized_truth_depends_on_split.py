"""microbatches(n) splits the same samples, but full_batch_loss() reads the first microbatch only."""

import torch
from _tiny import build_model, right_step
from _tiny import microbatches as _four

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]
step = right_step


def microbatches(n: int = 4) -> list[torch.Tensor]:
    return [x.clone() for x in torch.cat(_four()).tensor_split(n)]


def full_batch_loss(model: torch.nn.Module, microbatches: list[torch.Tensor]) -> torch.Tensor:
    return (model(microbatches[0]) ** 2).mean()
