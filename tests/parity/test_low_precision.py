"""``gradagg parity`` on steps written with ``torch.autocast`` (bf16 and fp16 on the CPU): judged at the tolerance
of the precision they compute in, their mistakes still blamed on the weighting, their round-off named as such.

The fixtures (tests/parity/scripts/autocast_*.py) are the examples' token model in float32 under
``torch.autocast("cpu", dtype)``: 8 microbatches of 95 valid tokens with unequal counts, so that a weighting
mistake is visible. One world per layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gradagg.parity import check_parity  # noqa: E402
from gradagg.parity.compare import RTOL_BY_DTYPE  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "scripts"
LAYOUTS = [(8,), (4, 4), (1, 7)]
FAST = {"timeout_s": 60.0, "collective_timeout_s": 5.0}
# float32's default tolerance: a right bf16 step misses the full batch by more than this (bf16 keeps 8 bits of
# mantissa, float32 24), so at this bar its error is round-off that must not be blamed on the weighting.
FLOAT32_RTOL = RTOL_BY_DTYPE["torch.float32"]


def _fixture(name: str) -> str:
    return str(FIXTURES / f"{name}.py")


@pytest.mark.parametrize(("name", "dtype"), [("autocast_bf16", "bfloat16"), ("autocast_fp16", "float16")])
def test_a_right_autocast_step_passes_at_its_dtypes_tolerance(name: str, dtype: str) -> None:
    """CPU autocast runs both bf16 and fp16: the full batch under the same autocast computes in that dtype, and
    the right step (summed loss, weight= its tokens) passes every layout at that dtype's tolerance."""
    report = check_parity(_fixture(name), LAYOUTS, **FAST)
    assert report.passed and report.dtype == dtype, report.observations
    assert report.rtol == RTOL_BY_DTYPE[f"torch.{dtype}"], report.rtol
    # The step's error is the low precision's round-off, not float64's: the forward really ran in it.
    assert min(o["actual"] for o in report.observations) > RTOL_BY_DTYPE["torch.float64"], report.observations


@pytest.mark.parametrize("name", ["autocast_bf16_mean_of_means", "autocast_bf16_mean_loss_with_weight"])
def test_a_weighting_mistake_under_autocast_still_fails_as_a_weighting_mistake(name: str) -> None:
    """bf16's wide tolerance does not hide a mean of per-microbatch means or a mean loss given weight=n: both
    miss by far more than round-off and the diagnosis names the weighting, never round-off."""
    report = check_parity(_fixture(name), LAYOUTS, **FAST)
    assert report.dtype == "bfloat16", report.dtype
    for o in report.observations:
        assert not o["passed"] and o["ratio"] is None, o
        assert o["diagnosis"].startswith("no single factor"), o
        assert "(a mean loss given weight=n, divided twice" in o["diagnosis"], o
        assert "round-off" not in o["diagnosis"], o


def test_a_right_bf16_step_beyond_float32s_tolerance_is_named_round_off() -> None:
    """At float32's tolerance the right bf16 step fails, and the diagnosis says round-off (naming bfloat16 and
    the tolerance that passes it), not a weighting mistake."""
    report = check_parity(_fixture("autocast_bf16"), [(4, 4)], rtol=FLOAT32_RTOL, **FAST)
    (o,) = report.observations
    assert not o["passed"] and o["actual"] > FLOAT32_RTOL and o["ratio"] is None, o
    assert o["diagnosis"].startswith("round-off, not a weighting mistake: "), o
    assert "bfloat16" in o["diagnosis"] and f"a tolerance of {RTOL_BY_DTYPE['torch.bfloat16']:g}" in o["diagnosis"]


def test_a_step_under_autocast_is_judged_at_its_precision_when_the_full_batch_is_float32() -> None:
    """The tolerance follows what the step computes in: a full batch written without autocast (float32) and a
    right step under bf16 autocast pass at bf16's tolerance, and the observation says why; at an explicit
    float32 tolerance the same step fails as round-off, not as a weighting mistake."""
    report = check_parity(_fixture("autocast_bf16_step_only"), LAYOUTS, **FAST)
    assert report.dtype == "float32", report.dtype  # the full batch's own precision
    for o in report.observations:
        assert o["passed"] and o["expected"] == f"<= {RTOL_BY_DTYPE['torch.bfloat16']:g}", o
        assert "autocast" in o["diagnosis"] and "bfloat16" in o["diagnosis"], o
    strict = check_parity(_fixture("autocast_bf16_step_only"), [(4, 4)], rtol=FLOAT32_RTOL, **FAST)
    (o,) = strict.observations
    assert not o["passed"] and o["diagnosis"].startswith("round-off, not a weighting mistake: "), o


def test_autocast_that_casts_nothing_leaves_the_float64_tolerance() -> None:
    """Autocast on around a float64 step casts none of its operations: the step computes in float64, so the
    layout keeps float64's tolerance (bf16's would let a divisor off by a few percent pass)."""
    report = check_parity(_fixture("autocast_noop_float64"), [(4, 4)], **FAST)
    (o,) = report.observations
    assert o["passed"] and o["expected"] == f"<= {RTOL_BY_DTYPE['torch.float64']:g}", o
    assert "autocast" not in o["diagnosis"], o
