"""Weights tied across pipeline stages (the first stage's embedding, the last stage's head): declared, then summed.

In one process a tied weight is one tensor, and autograd adds both uses' gradients into its ``.grad``. Split
across stages it is two tensors on two ranks, each with half the gradient. They must be summed over the
pipeline group before the optimizer (Megatron's embedding group all_reduce), and counted once in a norm
(Megatron PR #7227 fixed a norm that counted it twice). Ties are declared, not found: two tensors on two
ranks can only be told to be the same weight by comparing values, and equal values (zero-initialised biases)
do not make a tie. On one rank a tie is simply the same tensor object, counted once by the norm already.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gradagg.errors import GradaggError
from gradagg.torch.collectives import Group, all_gather_object, all_reduce_sum, device_for, get_rank

_Spec = tuple[tuple[int, ...], str]  # shape, dtype


class Ties:
    """The tie table of one pipeline: which pipeline ranks hold each tied weight, and which one counts it."""

    def __init__(self, local: Mapping[str, torch.Tensor], group: Group) -> None:
        self.group = group
        self.local = dict(local)
        mine = {name: (tuple(t.shape), str(t.dtype)) for name, t in self.local.items()}
        tables: list[dict[str, _Spec]] = all_gather_object(mine, group)  # type: ignore[assignment]
        self.names = sorted({n for table in tables for n in table})
        self.specs: dict[str, _Spec] = {}
        self.counter: dict[str, int] = {}
        for name in self.names:
            holders = [r for r, table in enumerate(tables) if name in table]
            specs = {tables[r][name] for r in holders}
            if len(specs) > 1:  # every rank saw the same tables, so every rank raises this
                raise GradaggError(f"tied weight {name!r} is declared with different (shape, dtype) on pipeline "
                                   f"ranks {holders}: {[tables[r][name] for r in holders]}")
            if len(holders) < 2:
                raise GradaggError(f"tied weight {name!r} is declared on pipeline rank {holders[0]} only: declare "
                                   "it on every rank holding a copy (on one rank, tie by using one tensor)")
            self.specs[name], self.counter[name] = specs.pop(), holders[0]

    def copies(self) -> list[torch.Tensor]:
        """The tied tensors held here that another rank counts in a norm (the first holder counts)."""
        rank = get_rank(self.group)
        return [t for name, t in self.local.items() if self.counter[name] != rank]

    def reduce(self) -> None:
        """Sum each tied weight's gradient over its holders; one all_reduce per dtype (none without ties)."""
        for dtype in sorted({spec[1] for spec in self.specs.values()}):
            names = [n for n in self.names if self.specs[n][1] == dtype]
            self._reduce(names, getattr(torch, dtype.removeprefix("torch.")))

    def _reduce(self, names: list[str], dtype: torch.dtype) -> None:
        # Layout: one presence count per weight, then the flat gradients; non-holders send zeros.
        sizes = [_numel(self.specs[n][0]) for n in names]
        buf = torch.zeros(len(names) + sum(sizes), dtype=dtype, device=device_for(self.group))
        offsets = [len(names) + sum(sizes[:i]) for i in range(len(names))]
        for i, name in enumerate(names):
            grad = self.local[name].grad if name in self.local else None
            if grad is not None:
                buf[i] = 1
                buf[offsets[i]:offsets[i] + sizes[i]] = grad.reshape(-1)
        all_reduce_sum(buf, self.group)
        holders = buf[:len(names)].tolist()  # one small read back for all ties of this dtype
        for i, name in enumerate(names):
            t = self.local.get(name)
            if t is not None and holders[i] > 0:
                t.grad = buf[offsets[i]:offsets[i] + sizes[i]].reshape(t.shape).to(t.device).clone()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
