"""A plain module, or tensors: the parameters hold their own gradients, the accumulator reduces them all.

:class:`Plain` is the :class:`~gradagg.torch.accumulate.seam.Wrapper` that adds nothing: every other wrapper
starts from it and overrides the points where it differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gradagg.torch.accumulate import hooks
from gradagg.torch.accumulate.buckets import Groups
from gradagg.torch.accumulate.state import State
from gradagg.torch.collectives import Group


class Plain:
    """No wrapper: every parameter's gradient hooked into the buffer and all-reduced over the group."""

    name = "plain"
    opens_together = False

    def __init__(self) -> None:
        self.sharded: frozenset[int] = frozenset()
        self.external: frozenset[int] = frozenset()
        self.ways, self.shard_rank = 1, 0

    def held(self) -> dict[int, torch.Tensor]:
        return {}

    def groups(self, group: Group) -> Groups:
        return Groups(group)

    def install(self, state: State) -> None:
        for i, t in enumerate(state.tensors):
            if i not in self.sharded:
                hooks.hook(state, t, i, hooks.on_grad)

    def open(self, state: State) -> None:
        return

    def microbatches(self, state: State, items: Iterable[Any]) -> Iterator[Any] | None:
        return None

    def before_microbatch(self, state: State, last: bool, lookahead: bool | None) -> bool:
        return last

    def refuse_hand_set(self, state: State) -> None:
        return

    def after_microbatch(self, state: State) -> None:
        return

    def explained(self, state: State, exc: BaseException) -> BaseException:
        return exc

    def prepare(self, state: State, ran: bool) -> None:
        return

    def after_exchange(self, state: State) -> None:
        return

    def hand_out(self, state: State, i: int, t: torch.Tensor, divisor: float, present: bool) -> None:
        raise RuntimeError(f"internal error: {self.name} holds no sharded or external parameter ({state.names[i]!r})")

    def close(self, state: State) -> None:
        return

    def discard(self, state: State) -> None:
        return

    def release(self) -> None:
        return

    def refuses_terms(self) -> str | None:
        return None


__all__ = ["Plain"]
