"""The accumulator in the precision people train in: ``torch.autocast`` bf16 and fp16, fp16 with ``GradScaler``.

2 gloo ranks, plain and DDP, uneven microbatches (a rank with none); workers in ``tests.torch.workers.amp``.
With a scaler, one window overflows on one rank: every rank sees the same non-finite gradient, GradScaler skips
the step on every rank and halves its scale, never a GradaggError (nonfinite="propagate", the default); the next
windows are exact again.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import amp

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0}
# The unscaled window gradient against the float64 full batch, relative (norm over every parameter): what autocast
# rounds in the forward and backward (bf16 keeps 8 significant bits, 2**-8 ~ 4e-3 per rounding; fp16 11 bits,
# 2**-11 ~ 5e-4), over a two-layer model: a few roundings deep. The window's sums themselves are float32.
BOUND = {"bf16": 3e-2, "fp16": 4e-3}


@pytest.mark.parametrize("attached", [False, True], ids=["finish", "attached"])
@pytest.mark.parametrize("layout", ["plain", "ddp"])
@pytest.mark.parametrize(("precision", "scaled"), [("bf16", False), ("fp16", True)])
def test_autocast_and_grad_scaler_are_exact_within_the_round_off(layout: str, precision: str, scaled: bool,
                                                                 attached: bool) -> None:
    """Window 0 runs no microbatch on rank 1: its GradScaler never scaled a loss, yet unscales the window's gradient
    (gradagg readies its scale; torch raised "unscale_ but _scale is None" before). Attached, ``unscale_`` (or
    the clip) finishes the window first (torch raised "No inf checks were recorded" before: it saw no gradient)."""
    ranks = run_local_world(amp.amp_world, 2, layout, precision, scaled, attached, **WORLD)
    assert ranks[0] == ranks[1] or _same(ranks[0], ranks[1]), ranks
    for window, case in enumerate(ranks[0]):
        overflow = scaled and window == amp.OVERFLOW[0]
        if overflow:  # every rank: non-finite, no step, the scale halved; no GradaggError
            assert not case["finite"] and not case["stepped"], case
            assert case["scale"] == ranks[0][window - 1]["scale"] / 2, (window, case)
            continue
        assert case["finite"] and case["stepped"], (window, case)
        assert case["error"] <= BOUND[precision], (window, case)
        assert case["naive"] > 5 * BOUND[precision], (window, case)  # the weighting is what the test can see


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Both ranks saw the same windows (NaN errors compare as equal)."""
    for x, y in zip(a, b, strict=True):
        for k in x:
            if not (x[k] == y[k] or (isinstance(x[k], float) and math.isnan(x[k]) and math.isnan(y[k]))):
                return False
    return True
