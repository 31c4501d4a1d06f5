"""Wrong about absence: a layer unused by the loss gets a zero gradient where the full batch leaves it None."""

import torch
from _tiny import full_batch_loss, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


class WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(3, 1)
        self.unused = torch.nn.Linear(3, 1)  # never in the forward: its grad is None in the truth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return WithUnused().double()


step = right_step  # writes zeros for every parameter without a gradient, the unused one included
