"""DeepSpeed's wrapper hands each rank's gradient sum to DeepSpeed's average divided by its share of the divisor,
D / world (D where DeepSpeed sums), by the one divisor rule (``counting.divisor_problem``): a share float32 cannot
divide by is refused; for a bf16 engine, the window is summed in float32 and rounded to bf16 once.

No DeepSpeed needed: :meth:`DeepSpeedZero.hand_out` reads only the window's world and the parameter. The refusal on
every rank of a real engine is ``test_deepspeed.py::test_a_share_float32_cannot_divide_by_is_refused_on_every_rank``.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gradagg.errors import WindowError
from gradagg.torch.accumulate.wrappers.deepspeed import DeepSpeedZero

FLOAT32_ULP = 2.0**-23


def _handed_out(grad: list[float], divisor: float, world: int, averages: bool = True) -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad, dtype=torch.float32)
    state: Any = SimpleNamespace(world=world, rank=0)
    DeepSpeedZero(None, 1, averages).hand_out(state, 0, p, divisor, True)
    assert p.grad is not None
    return p.grad


def test_a_share_near_float32s_smallest_normal_keeps_its_bits() -> None:
    """world / D just below float32's smallest normal (a subnormal with 21 bits) lost bits when multiplied by: the
    share D / world is a normal float32, and dividing by it rounds as the flat buffer's division by D does."""
    factor = (2**21 + 1.5) * 2.0**-149  # a subnormal float32 would round it by 0.5 / (2**21 + 1.5) of itself
    divisor = 1 / factor  # below float32's largest: finish() lets it through
    grad = [1e3 * (1 + k / 7) for k in range(64)]  # sums whose quotients are normal float32 (as is their truth)
    got = _handed_out(grad, divisor, 1).double().tolist()
    errors = [abs(g - t * factor) / (t * factor) for g, t in zip(got, grad, strict=True)]  # float64 truth
    assert max(errors) <= 1.5 * FLOAT32_ULP, max(errors)


def test_a_share_below_float32s_smallest_normal_is_refused() -> None:
    """D = 2e-38 over 8 ranks: world / D = 4e38 is beyond float32 (every gradient became inf, silently); the share
    D / world = 2.5e-39 is below its smallest normal: refused, naming D, the world and the share."""
    with pytest.raises(WindowError, match=r"D / world = 2\.5e-39, which is below the smallest normal float32") as e:
        _handed_out([1.0, 2.0], 2e-38, 8)
    assert "2e-38" in str(e.value) and "8 ranks" in str(e.value), e.value


@pytest.mark.parametrize("world", [1, 2, 8])
def test_the_share_is_the_divisor_over_the_ranks(world: int) -> None:
    """Ordinary divisors: each element is its sum times world / D, within float32's rounding (float64 truth); a
    parameter with no gradient gets zeros of its shape."""
    grad = [3.0, -1.5, 0.25, 7.0]
    got = _handed_out(grad, 13.0, world).double().tolist()
    for g, t in zip(got, grad, strict=True):
        assert abs(g - t * world / 13.0) <= FLOAT32_ULP * abs(t * world / 13.0), (g, t)
    p = torch.nn.Parameter(torch.ones(3))
    DeepSpeedZero(None, 1).hand_out(SimpleNamespace(world=world, rank=0), 0, p, 13.0, False)  # type: ignore[arg-type]
    assert p.grad is not None and p.grad.tolist() == [0.0, 0.0, 0.0]


def test_where_deepspeed_sums_the_share_is_the_divisor() -> None:
    """gradient_allreduce_op "sum": DeepSpeed adds the ranks' gradients, so each rank's sum is divided by D itself."""
    got = _handed_out([3.0, -1.5], 13.0, 4, averages=False).double().tolist()
    for g, t in zip(got, [3.0, -1.5], strict=True):
        assert abs(g - t / 13.0) <= FLOAT32_ULP * abs(t / 13.0), (g, t)


def test_where_deepspeed_sums_a_divisor_the_dtype_cannot_divide_by_is_refused_naming_the_sum() -> None:
    """The message names the rule as DeepSpeed reduces: summing, the share is D itself (here 1e5, beyond a float16
    gradient; exact() refuses fp16 engines, the wrapper's rule is the same for every dtype)."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    p.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(WindowError, match=r"DeepSpeed sums over the ranks, so each rank's gradient sum is divided by "
                                          r"D = 100000\.0, which is beyond what float16 sums can be divided by"):
        DeepSpeedZero(None, 1, averages=False).hand_out(SimpleNamespace(world=2, rank=1), 0, p, 1e5, True)  # type: ignore[arg-type]


def test_bf16_gradients_are_summed_in_float32_and_rounded_once() -> None:
    """A bf16 parameter (DeepSpeed's bf16 engine) gets 256, then 1 sixteen times, one per microbatch: a bf16 running
    sum stays at 256 (256 + 1 rounds back to 256 in bf16's 8 bits), the wide wrapper's float32 sum is 272, and the
    handed-out gradient is 272 / (D / world) rounded to bf16 once; the sums are gone after the hand-out, and a
    dropped window forgets them."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    state: Any = SimpleNamespace(world=2, rank=0, tensors=[p])
    wrapper = DeepSpeedZero(None, 1, wide=True)
    wrapper.block = contextlib.ExitStack()  # the window's block, open (no engine: nothing to enter)
    narrow = torch.zeros(2, dtype=torch.bfloat16)
    for value in [256.0] + [1.0] * 16:
        p.grad = torch.full((2,), value, dtype=torch.bfloat16)
        narrow += p.grad
        wrapper.after_microbatch(state)
        assert p.grad is None
    assert narrow.tolist() == [256.0, 256.0]
    wrapper.hand_out(state, 0, p, 34.0, True)  # D = 34 over 2 ranks: the share is 17, and 272 / 17 = 16
    assert p.grad is not None and p.grad.dtype == torch.bfloat16 and p.grad.tolist() == [16.0, 16.0]
    assert wrapper.sums == {}
    p.grad = torch.ones(2, dtype=torch.bfloat16)
    wrapper.after_microbatch(state)
    wrapper.discard(state)
    assert wrapper.sums == {} and wrapper.block is None
