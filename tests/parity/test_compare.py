"""The comparison, on hand-made gradients (no processes): relative error, floor, absence, NaN, diagnoses.

The property tests cover the class of divisor mistakes: any gradients that are k times the truth
(k away from 1 by more than the tolerance) fail and report k; gradients within the tolerance pass.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from gradagg.parity.compare import default_rtol, judge, ratio_text  # noqa: E402
from gradagg.parity.types import FLOOR, Truth, Unread  # noqa: E402

RTOL = 1e-9


def _truth(**grads: torch.Tensor | None) -> Truth:
    return Truth.of(dict(grads))


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_relative_error_is_per_parameter_and_norm_based() -> None:
    """a (norm 5) is off by 1e-3 of its norm, b (norm 100) exact: the worst is a at 1e-3, not 5e-3 / 100.

    a is above the floor (1% of the whole norm, ~1.0), so it is judged against its own norm.
    """
    truth = _truth(a=_t(3.0, 4.0), b=_t(100.0))
    got = {"a": _t(3.0, 4.0 + 5e-3), "b": _t(100.0)}
    o = judge((1,), truth, {0: got}, {}, rtol=RTOL)
    assert o["parameter"] == "a" and o["actual"] == pytest.approx(1e-3)
    assert o["passed"] is False and o["expected"] == "<= 1e-09"


def test_a_near_zero_truth_is_judged_against_the_floor() -> None:
    """b's truth is 0: its error 1e-6 is measured against 1% of the whole norm (5), not against 0."""
    truth = _truth(a=_t(3.0, 4.0), b=_t(0.0))
    o = judge((1,), truth, {0: {"a": _t(3.0, 4.0), "b": _t(1e-6)}}, {}, rtol=1e-3)
    assert truth.floor == pytest.approx(FLOOR * 5.0)
    assert o["parameter"] == "b" and o["actual"] == pytest.approx(1e-6 / (FLOOR * 5.0)) and o["passed"]


@pytest.mark.parametrize(("truth_b", "got_b", "message"), [
    (None, _t(0.0, 0.0), "'b' has a gradient (all zeros) where the full batch has none: absent is not zero"),
    (_t(1.0, 1.0), None, "'b' has no gradient; the full batch's has norm 1.41"),
    (_t(1.0, 1.0), _t(1.0), "'b' has a gradient of shape [1], the full batch's is [2] (a shard, not gathered?)"),
])
def test_absent_and_present_never_match_whatever_the_tolerance(truth_b: torch.Tensor | None,
                                                               got_b: torch.Tensor | None, message: str) -> None:
    truth = _truth(a=_t(1.0), b=truth_b)
    o = judge((1,), truth, {0: {"a": _t(1.0), "b": got_b}}, {}, rtol=0.99)
    assert o["passed"] is False and o["actual"] == f"rank 0: {message}"


def test_absent_on_both_sides_agrees() -> None:
    o = judge((1,), _truth(a=_t(1.0), b=None), {0: {"a": _t(1.0), "b": None}}, {}, rtol=0.0)
    assert o["passed"] is True and o["actual"] == 0.0


def test_nan_fails_whatever_the_tolerance_and_is_strict_json() -> None:
    o = judge((1,), _truth(a=_t(1.0, 2.0)), {0: {"a": _t(math.nan, 2.0)}}, {}, rtol=0.99)
    assert o["passed"] is False and o["actual"] == "nan"
    assert "1 non-finite entries (NaN or Inf) out of 2" in o["diagnosis"]


def test_failed_ranks_put_the_first_hand_failure_first() -> None:
    failures = {0: "step() raised RuntimeError: Connection closed by peer", 1: "step() raised KeyError: 'x'"}
    o = judge((2, 2), _truth(a=_t(1.0)), {}, failures, rtol=RTOL)
    assert o["passed"] is False and o["rank"] == 1
    assert o["actual"] == "rank 1: step() raised KeyError: 'x'; rank 0: step() raised RuntimeError: Connection " \
                          "closed by peer"
    assert o["diagnosis"] == "rank 1: step() raised KeyError: 'x'; then rank 0, waiting for it"


def test_ranks_that_disagree_are_named_before_any_ratio() -> None:
    truth = _truth(a=_t(1.0, 1.0))
    o = judge((1, 1), truth, {0: {"a": _t(1.0, 1.0)}, 1: {"a": _t(2.0, 1.0)}}, {}, rtol=RTOL)
    assert o["diagnosis"].startswith("ranks disagree: 'a' on rank 1 differs from rank 0's")


@pytest.mark.parametrize(("ratio", "world", "window", "text"), [
    (0.5, 2, 8, "a divisor twice too large (the world size, 2: divided by the ranks on top of a global divisor?)"),
    (2.0, 2, 8, "a divisor twice too small (the world size, 2: summed over the ranks where a mean belongs?)"),
    (8.0, 2, 8, "a divisor 8 times too small (the number of microbatches, 8"),
    (95.0, 2, 8, "a divisor 95 times too small (a division left out?)"),
    (0.25, 1, 8, "a divisor 4 times too large?"),
    (-1.0, 1, 8, "a sign flipped?"),
    (0.0, 1, 8, "every gradient is zero"),
])
def test_ratio_text_names_the_likely_divisor(ratio: float, world: int, window: int, text: str) -> None:
    assert text in ratio_text(ratio, world, window)


_sizes = st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=4)
_scale = st.floats(min_value=1e-3, max_value=1e3).filter(lambda k: abs(k - 1) > 1e-6)


@settings(max_examples=60, deadline=None)
@given(sizes=_sizes, k=_scale, seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_any_common_factor_fails_and_is_reported(sizes: list[int], k: float, seed: int) -> None:
    """Gradients that are k x the truth everywhere (every rank alike) fail with ratio k and the sentence for k."""
    gen = torch.Generator().manual_seed(seed)
    truth = Truth.of({f"p{i}": torch.randn(n, generator=gen, dtype=torch.float64) + 3.0
                      for i, n in enumerate(sizes)})
    got = {name: k * t for name, t in truth.grads.items() if t is not None}
    o = judge((2, 3), truth, {0: got, 1: dict(got)}, {}, rtol=RTOL)
    assert o["passed"] is False, f"seed {seed}"
    assert o["ratio"] == pytest.approx(k, rel=1e-9), f"seed {seed}"
    assert o["diagnosis"].startswith(f"grads are {k:.3g}x the truth on every parameter"), f"seed {seed}"


@settings(max_examples=60, deadline=None)
@given(sizes=_sizes, noise=st.floats(min_value=0.0, max_value=0.5), seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_round_off_below_the_tolerance_passes(sizes: list[int], noise: float, seed: int) -> None:
    """A perturbation of at most half the tolerance (relative to the floor) passes on every rank."""
    gen = torch.Generator().manual_seed(seed)
    truth = Truth.of({f"p{i}": torch.randn(n, generator=gen, dtype=torch.float64) for i, n in enumerate(sizes)})
    rtol = 1e-6
    got = {}
    for name, t in truth.grads.items():
        assert t is not None
        bump = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        got[name] = t + bump / float(bump.norm()) * noise * rtol * truth.scale(name)
    o = judge((1,), truth, {0: got}, {}, rtol=rtol)
    assert o["passed"] is True and o["actual"] <= 0.5 * rtol * (1 + 1e-9), f"seed {seed}"


def test_default_rtol_follows_the_lowest_precision() -> None:
    assert default_rtol(_truth(a=_t(1.0))) == 1e-9
    assert default_rtol(_truth(a=_t(1.0), b=torch.ones(1, dtype=torch.float32))) == 1e-3
    assert default_rtol(_truth(a=torch.ones(1, dtype=torch.bfloat16))) == 5e-2


@pytest.mark.parametrize(("layout", "uneven"), [((1, 3), True), ((2, 2), False)])
def test_every_rank_failing_in_a_collective_reads_as_collectives_that_do_not_match(
        layout: tuple[int, ...], uneven: bool) -> None:
    """Both ranks time out (or lose each other) inside step(): neither is the cause, their collectives differ.

    With unequal counts per rank the likely cause is a collective per microbatch (FSDP's, DDP's) and the
    diagnosis says so; with equal counts it does not guess that.
    """
    failures = {0: "step() raised RuntimeError: Timed out waiting 3000ms for recv operation to complete",
                1: "step() raised RuntimeError: Timed out waiting 3000ms for send operation to complete"}
    o = judge(layout, _truth(a=_t(1.0)), {}, failures, rtol=RTOL)
    assert o["passed"] is False and o["rank"] == 0
    assert o["diagnosis"].startswith("every rank failed inside a collective, timed out or left by its peer (rank 0: "
                                     "step() raised RuntimeError: Timed out waiting 3000ms for recv"), o["diagnosis"]
    assert "do not run the same collectives in the same order" in o["diagnosis"]
    assert ("different numbers of microbatches" in o["diagnosis"]) is uneven


def test_ranks_left_waiting_by_one_that_returned_are_told_so() -> None:
    """Rank 0 (no microbatch) returned; ranks 1 to 3 lost it in a collective: it is named as the one that left."""
    lost = "step() raised RuntimeError: Connection closed by peer"
    o = judge((0, 2, 3, 3), _truth(a=_t(1.0)), {0: {"a": None}}, {1: lost, 2: lost, 3: lost}, rtol=RTOL)
    assert o["passed"] is False and o["rank"] == 1
    assert o["diagnosis"] == (f"rank 1: {lost} (rank 0 returned from step() while rank 1, 2, 3 waited for it in a "
                              "collective: does every rank run the same collectives, a rank with no microbatch "
                              "included?)")


def test_a_gradient_that_could_not_be_read_fails_with_its_reason() -> None:
    """An Unread gradient (a DTensor whose shards do not assemble) fails whatever the tolerance, saying why."""
    truth = _truth(a=_t(1.0), b=_t(1.0, 1.0))
    o = judge((1, 1), truth, {0: {"a": _t(1.0), "b": Unread("'b' cannot be assembled: because")},
                              1: {"a": _t(1.0), "b": _t(1.0, 1.0)}}, {}, rtol=0.99)
    assert o["passed"] is False and o["rank"] == 0 and o["parameter"] == "b"
    assert o["actual"] == "rank 0: 'b' cannot be assembled: because" and o["diagnosis"] == o["actual"]


@settings(max_examples=60, deadline=None)
@given(sizes=_sizes, noise=st.floats(min_value=0.05, max_value=0.9), seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_an_error_within_the_computing_dtypes_round_off_is_named_round_off(sizes: list[int], noise: float,
                                                                           seed: int) -> None:
    """Above an explicit tolerance but within the round-off of what the full batch computes in (float32 here):
    named round-off, with no factor and no weighting cause."""
    gen = torch.Generator().manual_seed(seed)
    truth = Truth.of({f"p{i}": torch.randn(n, generator=gen, dtype=torch.float64) + 3.0
                      for i, n in enumerate(sizes)}, "torch.float32", 1e-3)
    got = {}
    for name, t in truth.grads.items():
        assert t is not None
        bump = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        got[name] = t + bump / float(bump.norm()) * noise * truth.roundoff * truth.scale(name)
    o = judge((2, 2), truth, {0: got, 1: dict(got)}, {}, rtol=RTOL)
    assert o["passed"] is False and o["ratio"] is None, f"seed {seed}"
    assert o["diagnosis"].startswith("round-off, not a weighting mistake"), f"seed {seed}: {o['diagnosis']}"
    assert "float32" in o["diagnosis"] and "mean of" not in o["diagnosis"], f"seed {seed}"


@settings(max_examples=60, deadline=None)
@given(sizes=_sizes, k=st.floats(min_value=1.01, max_value=100.0), seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_a_mistake_beyond_the_round_off_is_still_named_a_mistake(sizes: list[int], k: float, seed: int) -> None:
    """A factor or a reweighting larger than the round-off of the computing dtype keeps its diagnosis."""
    gen = torch.Generator().manual_seed(seed)
    truth = Truth.of({f"p{i}": torch.randn(n, generator=gen, dtype=torch.float64) + 3.0
                      for i, n in enumerate(sizes)}, "torch.float32", 1e-3)
    scaled = {name: k * t for name, t in truth.grads.items() if t is not None}
    o = judge((2, 2), truth, {0: scaled, 1: dict(scaled)}, {}, rtol=RTOL)
    assert o["ratio"] == pytest.approx(k, rel=1e-9), f"seed {seed}"
    first = next(iter(truth.grads))
    reweighted = {name: (k if name == first else 1.0) * t for name, t in truth.grads.items() if t is not None}
    if len(reweighted) > 1:
        o = judge((2, 2), truth, {0: reweighted, 1: dict(reweighted)}, {}, rtol=RTOL)
        assert o["diagnosis"].startswith("no single factor"), f"seed {seed}: {o['diagnosis']}"


@pytest.mark.parametrize("cast", [torch.float32, torch.bfloat16, torch.float16])
def test_the_lowest_dtype_an_operation_computes_in_is_seen(cast: torch.dtype) -> None:
    """A float64 model whose loss casts its output: the cast's dtype is what the truth computes in."""
    from gradagg.parity.precision import DtypesSeen

    model = torch.nn.Linear(3, 2).double()
    with DtypesSeen() as seen:
        loss = model(torch.ones(4, 3, dtype=torch.float64)).to(cast).float().square().mean()
        loss.backward()
    assert seen.lowest() == str(cast)
    with DtypesSeen() as plain:
        model(torch.ones(4, 3, dtype=torch.float64)).square().mean().backward()
    assert plain.lowest() == "torch.float64"


def test_a_loss_that_reads_dtype_and_shape_computes_in_its_dtype() -> None:
    """``x.to(w.dtype)`` and ``x.shape`` return a dtype and a Size through the mode, not tensors: they are not
    results to record (a dtype has an ``is_floating_point`` attribute that is a bool, not a method)."""
    from gradagg.parity.precision import DtypesSeen

    model = torch.nn.Linear(3, 2).double()
    with DtypesSeen() as seen:
        out = model(torch.ones(4, 3, dtype=torch.float64))
        mask = (out > 0).to(out.dtype)
        (out * mask).sum().div(out.shape[0]).backward()
    assert seen.lowest() == "torch.float64"


def test_a_miss_on_a_parameter_below_the_floor_is_not_called_a_common_factor() -> None:
    """The projection skips parameters whose truth is below the floor (no reliable ratio of their own); a miss
    there, the rest exact, is still no single factor: not "grads are 1x the truth on every parameter"."""
    gen = torch.Generator().manual_seed(0)
    truth = Truth.of({"big": torch.randn(10_000, generator=gen, dtype=torch.float64) + 3.0,
                      "small": torch.tensor([3.0], dtype=torch.float64)}, "torch.float64", 1e-9)
    assert truth.norms["small"] < truth.floor
    got = {"big": truth.grads["big"], "small": 2 * truth.grads["small"]}  # type: ignore[operator]
    o = judge((2, 2), truth, {0: got, 1: dict(got)}, {}, rtol=1e-9)
    assert o["passed"] is False and o["ratio"] is None, o["diagnosis"]
    assert o["diagnosis"].startswith("no single factor"), o["diagnosis"]
