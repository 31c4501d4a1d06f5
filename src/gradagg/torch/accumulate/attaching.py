"""``attach``: finish the window from the optimizer's step, for loops a framework owns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradagg.torch.accumulate.state import State


def attach(state: State, optimizer: torch.optim.Optimizer, finish: Callable[[], object]) -> Any:
    """Run ``finish`` from ``optimizer``'s step pre-hook; clip after the step's pre-hooks (or not at all).

    Args:
        state: the accumulator (the handle is kept in ``state.extra_hooks``, removed on close).
        optimizer: any ``torch.optim.Optimizer``.
        finish: the accumulator's ``finish``.

    Returns:
        The hook's handle.
    """

    def finish_first(_opt: object, _args: object, _kwargs: object) -> None:
        finish()

    handle = optimizer.register_step_pre_hook(finish_first)
    state.extra_hooks.append(handle)
    return handle


__all__ = ["attach"]
