"""Hostile microbatch weights (property test): the right gradient with D = the exact total, or a GradaggError.

One process (the same code path as every rank; the 2-rank cases are in test_hostile.py). Weights are drawn
from what a hostile caller can pass: floats anywhere in float64 (subnormal, huge, negative, NaN, Inf), ints
beyond float64, 0-dim tensors of several dtypes, on the meta device too. The expectation is computed here,
independently: a weight counts if it is a finite non-negative real with a value; D = math.fsum of them must
be finite and within the normal range of the sums' dtype (float32 at least); otherwise finish() raises.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from gradagg.errors import GradaggError
from gradagg.torch import MicrobatchAccumulator

FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e39, 1e308, 1.7e308, 1e-45, 0.0, 5e-324])
INTS = st.integers(-(2**70), 10**400) | st.integers(0, 1000)
TENSOR_DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.uint8])
TENSORS = st.builds(
    lambda v, dtype, meta: torch.tensor(v).to(dtype) if not meta else torch.tensor(v, device="meta"),
    st.integers(0, 2000) | st.floats(-1e5, 1e5),
    TENSOR_DTYPES,
    st.booleans(),
)
WEIGHTS = st.lists(FLOATS | INTS | TENSORS, min_size=1, max_size=4)


def expected_divisor(weights: list[object], dtype: torch.dtype) -> float | None:
    """The exact total weight rounded once, or None where finish() must raise."""
    values = []
    for w in weights:
        if isinstance(w, torch.Tensor):
            if w.is_meta:
                return None
            v = float(w.double())
        else:
            try:
                v = float(w)  # type: ignore[arg-type]
            except OverflowError:
                return None
        if not math.isfinite(v) or v < 0:
            return None
        values.append(v)
    try:
        total = math.fsum(values)
    except OverflowError:
        return None
    finfo = torch.finfo(torch.promote_types(torch.float32, dtype))
    return total if finfo.tiny <= total <= finfo.max else None


@settings(max_examples=150, deadline=None)
@given(weights=WEIGHTS, dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_hostile_weights(weights: list[object], dtype: torch.dtype, seed: int) -> None:
    """Microbatch k back-propagates c_k * sum(p), c_k in [0.5, 2): p.grad = sum(c) / D, within float rounding
    (4 eps relative: a sum of <= 4 terms and one division) plus the dtype's smallest normal (a result may be
    subnormal); or GradaggError exactly when the expectation says so, never another exception."""
    g = torch.Generator().manual_seed(seed)
    coefs = (torch.rand(len(weights), generator=g, dtype=torch.float64) * 1.5 + 0.5).tolist()
    p = torch.zeros(2, dtype=dtype, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    want = expected_divisor(weights, dtype)
    try:
        for c, w in zip(coefs, weights):
            with acc.microbatch(weight=w):
                (p.sum() * c).backward()
        ledger = acc.finish()
    except GradaggError as exc:
        assert want is None, (weights, want, str(exc))
        acc.discard()
        with acc.microbatch(weight=1):  # the accumulator is usable again
            p.sum().backward()
        assert acc.finish().divisor == 1.0 and p.grad is not None and bool((p.grad == 1).all())
        return
    assert want is not None, (weights, ledger.divisor, p.grad)
    assert ledger.divisor == want, (weights, ledger.divisor, want)
    finfo = torch.finfo(dtype)
    truth = math.fsum(coefs) / want
    assert p.grad is not None
    assert float((p.grad.double() - truth).abs().max()) <= 4 * finfo.eps * abs(truth) + finfo.tiny, (weights, p.grad)
