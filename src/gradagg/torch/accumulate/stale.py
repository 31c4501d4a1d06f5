"""Gradients present when a window opens: a stale ``.grad`` would be summed into the next window's."""

from __future__ import annotations

from gradagg.errors import WindowError
from gradagg.torch.accumulate.state import State


def stale_param(state: State) -> str | None:
    """The first parameter (or unsharded one) that holds a gradient, or None."""
    tensors = [(state.names[i], t) for i, t in enumerate(state.tensors)]
    tensors += [(state.names[i], t) for i, t in state.unsharded.items()]
    return next((n for n, t in tensors if t.grad is not None), None)


def refuse_stale(state: State) -> None:
    """Raise if a parameter holds a gradient as a window opens on a rank that runs a microbatch.

    Raises:
        WindowError: naming the parameter.
    """
    name = stale_param(state)
    if name is not None:
        raise WindowError(
            f"parameter {name!r} already has a gradient when the accumulation window opens; "
            "zero the gradients with optimizer.zero_grad() (set_to_none=True) after each step"
        )


__all__ = ["refuse_stale", "stale_param"]
