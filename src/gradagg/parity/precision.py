"""What a rank's step computes in under ``torch.autocast``, and the tolerance that follows from it.

The full batch's precision is what ``full_batch_loss()`` computes in (:class:`DtypesSeen`).
A step may compute in lower precision than that: written under ``torch.autocast`` where the full batch is not. Its
error against the truth is then that precision's round-off, and judging it at the truth's tolerance would blame the
weighting for round-off. Each rank records the autocast dtype its step's operations ran under (:class:`DtypesSeen`
with ``autocast_only``); :func:`step_precision` judges the layout at the lowest of those and the truth's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gradagg.parity.types import Truth

# Where autocast can be on for a step: the CPU and CUDA (autocast's other backends are not tested here).
_DEVICES = ("cpu", "cuda")


class DtypesSeen:
    """Records the dtypes of torch operations' results while entered (a public ``torch.overrides.TorchFunctionMode``;
    it reads, it changes nothing): every floating dtype, or with ``autocast_only`` only a dtype an enabled autocast
    casts to (autocast on but casting nothing, as it leaves float64 alone, records nothing).

    The full batch's recorder (a float64 model whose loss casts to float32 computes in float32), and each rank's
    step's under autocast.
    """

    def __init__(self, autocast_only: bool = False) -> None:
        self.autocast_only = autocast_only
        self.seen: set[Any] = set()
        self._mode: Any = None

    def __enter__(self) -> DtypesSeen:
        import torch
        from torch.overrides import TorchFunctionMode

        seen, autocast_only = self.seen, self.autocast_only

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                casts = {torch.get_autocast_dtype(d) for d in _DEVICES if torch.is_autocast_enabled(d)}
                if autocast_only and not casts:
                    return out
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    # a dtype is metadata: no read of a value; not ``.dtype``'s dtype, ``.shape``'s Size
                    if isinstance(t, torch.Tensor) and (t.dtype in casts if autocast_only else t.is_floating_point()):
                        seen.add(t.dtype)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    def lowest(self) -> str:
        """The dtype seen with the largest machine epsilon (``"torch.bfloat16"``), or "" if none was seen."""
        import torch

        return str(max(self.seen, key=lambda d: (torch.finfo(d).eps, str(d)))) if self.seen else ""


def step_precision(truth: Truth, rtol: float, explicit: bool, steps: Iterable[str]) -> tuple[Truth, float, str]:
    """The truth and tolerance to judge a layout by, when its ranks' steps computed in ``steps`` under autocast.

    Args:
        truth: the full batch's truth (its ``roundoff`` from what it computes in).
        rtol: the tolerance chosen for the full batch.
        explicit: whether the user gave ``rtol`` (it is then kept: only the diagnosis of round-off widens).
        steps: each rank's :meth:`DtypesSeen.lowest` ("" where autocast was off).

    Returns:
        (the truth, with the step's round-off where it is wider; the tolerance; a note for the diagnosis, or "").
    """
    from gradagg.parity.compare import RTOL_BY_DTYPE

    lowest = max(steps, key=lambda d: RTOL_BY_DTYPE.get(d, 0.0), default="")
    roundoff = RTOL_BY_DTYPE.get(lowest, 0.0)
    if roundoff <= truth.roundoff:
        return truth, rtol, ""
    dtype = lowest.removeprefix("torch.")
    wider = dataclasses.replace(truth, roundoff=roundoff, computes_in=lowest)
    return wider, rtol if explicit else max(rtol, roundoff), (
        f" (the step computes in {dtype} under autocast, the full batch in "
        f"{truth.computes_in.removeprefix('torch.') or 'its own precision'}: judged at {dtype}'s round-off)")
