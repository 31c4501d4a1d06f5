"""Wrong: each rank divides its own gradient sum by the global count and never all-reduces the gradients.

Right in one process; with two ranks the ranks disagree with each other (and with the truth).
"""

from _tiny import build_model, count_and_backward, full_batch_loss, microbatches

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]


def step(model, microbatches) -> None:
    count = count_and_backward(model, microbatches)
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= count
