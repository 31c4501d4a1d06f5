"""Right, and chatty: prints on import and in every step; stdout must still carry the JSON only."""

from _tiny import build_model, full_batch_loss, microbatches, right_step

__all__ = ["build_model", "full_batch_loss", "microbatches", "step"]
print("importing prints.py")


def step(model, microbatches) -> None:
    print(f"step with {len(microbatches)} microbatches")
    right_step(model, microbatches)
