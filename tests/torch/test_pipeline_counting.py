"""One counting (issue 24): the pipeline's last stage takes, checks and sums its counts as the accumulator does.

One process, no world: :class:`gradagg.torch.pipeline.counts.Counts` (what ``PipelineAccumulator.loss`` records)
against :mod:`gradagg.torch.accumulate.counting` (what ``MicrobatchAccumulator`` counts with) and against
``MicrobatchAccumulator.finish()`` itself, over counts drawn from what a hostile loss function returns: floats
anywhere in float64 (NaN, Inf, negative, huge), ints beyond float64, tensors of several dtypes (on the meta device
too), and what is not one real number. The expected values are computed here, independently of ``counting``: which
counts are refused, which one is named and why, and the total (an exact rational sum, rounded once). The step's refusal
on every rank, in these words, is tests/torch/test_pipeline.py's.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, seed, settings

from gradagg.errors import GradaggError, WindowError
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.accumulate.counting import Read, Tally, check_weight, divisor_problem
from gradagg.torch.pipeline.counts import Counts, local_tokens

COUNT_SEED = 2424  # hypothesis's seed for the test below: a failure reproduces with it
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, 16777217.0, 0.1, 0.0, 5e-324])
INTS = st.integers(-(2**70), 10**400) | st.integers(0, 1000)
DTYPES = st.sampled_from([torch.float16, torch.float32, torch.float64, torch.int64, torch.uint8])
TENSORS = st.builds(  # 0-dim, or shape (1,): a pipeline count may be one element of any shape (keepdim=True)
    lambda v, dtype, shape, meta: torch.full(shape, v, device="meta") if meta else torch.full(shape, v).to(dtype),
    st.integers(0, 2000) | st.floats(-1e5, 1e5),
    DTYPES,
    st.sampled_from([(), (1,)]),
    st.booleans(),
)
NOT_ONE_NUMBER = st.sampled_from(["bool", "complex", "str", "None", "list", "bool tensor", "2 elements", "complex t"])
MAKE = {
    "bool": lambda: True, "complex": lambda: 1j, "str": lambda: "3", "None": lambda: None, "list": lambda: [2],
    "bool tensor": lambda: torch.tensor(True), "2 elements": lambda: torch.ones(2),
    "complex t": lambda: torch.tensor(1j),
}
COUNTS = FLOATS | INTS | TENSORS | NOT_ONE_NUMBER.map(lambda k: MAKE[k]())


def _raised(fn: Callable[..., object], *args: object) -> str | None:
    try:
        fn(*args)
    except GradaggError as exc:
        return str(exc)
    return None


def _value(count: object) -> float:
    """The count's value, independently: NaN on the meta device, +-inf for an int beyond float64."""
    if isinstance(count, torch.Tensor):
        return math.nan if count.is_meta else float(count.double().reshape(()))
    try:
        return float(count)  # type: ignore[arg-type]
    except OverflowError:
        return math.inf if count > 0 else -math.inf  # type: ignore[operator]


def _refused(count: object) -> bool:
    """Whether a count is not one real number, independently: bool, complex, text, None, a list, a tensor of bool,
    of complex numbers or of more than one element (one element of any shape is a pipeline count)."""
    if isinstance(count, torch.Tensor):
        return count.numel() != 1 or count.dtype == torch.bool or count.is_complex()
    return isinstance(count, (bool, complex, str, list)) or count is None


def _problem(kept: list[tuple[object, float]]) -> str | None:
    """The fragment the first count that cannot count is named by, independently: a tensor on the meta device, a
    value that is NaN, infinite or negative (by its microbatch), else an exact sum (Fraction) beyond float64."""
    for k, (count, value) in enumerate(kept):
        if isinstance(count, torch.Tensor) and count.is_meta:
            return f"microbatch {k} has a weight tensor on the meta device"
        if value != value or value in (math.inf, -math.inf) or value < 0:
            return f"microbatch {k} has weight {value}:"
    return None if _total(kept) is not None else "sum beyond float64"


def _total(kept: list[tuple[object, float]]) -> float | None:
    """The float64 recount: the exact rational sum of the values, rounded once (None beyond float64, or for a value
    that is not finite)."""
    try:
        return float(sum((Fraction(v) for _, v in kept), Fraction(0)))
    except (OverflowError, ValueError):  # a sum beyond float64; Fraction(inf), Fraction(nan)
        return None


def _same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _accumulator_agrees(counts: list[object], want: Read) -> None:
    """MicrobatchAccumulator over the same counts: refuses in the same words, or divides by the same exact sum."""
    p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    for c in counts:
        with acc.microbatch(weight=c):
            p.sum().backward()
    try:
        divisor = acc.finish().divisor
    except WindowError as exc:
        if want.problem is not None:
            assert want.problem in str(exc), (want, str(exc))
        else:  # a total the float64 sums cannot be divided by (0, subnormal): the accumulator's own dtype check
            assert not want.total >= torch.finfo(torch.float64).tiny and "total weight" in str(exc), (want, str(exc))
        return
    assert want.problem is None and divisor == want.total, (want, divisor)


# the classes of counts and steps the draws must reach (test_pipeline_counts_as_the_accumulator)
CLASSES = ("refused: not one number", "a tensor of shape (1,)", "a tensor overwritten after", "named: meta tensor",
           "named: NaN, infinite or negative", "named: a sum beyond float64", "counted")
reached: Counter[str] = Counter()


@seed(COUNT_SEED)
@settings(max_examples=150, deadline=None)
@given(counts=st.lists(COUNTS, min_size=1, max_size=5))
def pipeline_counts(counts: list[object]) -> None:
    """One step's counts of test_pipeline_counts_as_the_accumulator."""
    pipe, tally, losses, kept = Counts(), Tally(), [], []
    for c in counts:
        loss = torch.zeros((), requires_grad=True)
        as_weight = c.reshape(()) if isinstance(c, torch.Tensor) and c.numel() == 1 else c  # what differs
        refused = _raised(pipe.record, loss, c)
        assert (refused is not None) == _refused(c), (c, refused)
        reached.update(["refused: not one number"] * (refused is not None) + ["a tensor of shape (1,)"] * (
            refused is None and isinstance(c, torch.Tensor) and c.dim() == 1))
        assert refused == _raised(tally.add, as_weight), (c, refused)
        if refused is None:
            losses.append(loss)
            kept.append((as_weight.clone() if isinstance(as_weight, torch.Tensor) else as_weight, _value(c)))
            if isinstance(c, torch.Tensor) and not c.is_meta:
                c.fill_(7)  # a count tensor the loss function reuses: each microbatch counted its value when given
                reached["a tensor overwritten after"] += 1
    pipe.keep(losses)
    want, problem, total = tally.read(), _problem(kept), _total(kept)
    if kept:
        reached[_class_of(problem)] += 1
    assert _same(pipe.read.values, tuple(v for _, v in kept)) and _same(pipe.read.values, want.values), counts
    assert pipe.read.problem == want.problem, (pipe.read, want)  # the same words as the accumulator's
    assert (want.problem is None) == (problem is None) and (problem is None or problem in want.problem), (
        want.problem, problem)
    assert problem is not None or pipe.read.total == want.total == total, (pipe.read, total)
    assert (pipe.problems() != []) == (problem is not None)
    if kept:  # none: no microbatch to compare (the accumulator's M = 0 is its own refusal)
        _accumulator_agrees([w for w, _ in kept], Read(want.values, want.problem, math.nan if total is None else total))


def _class_of(problem: str | None) -> str:
    if problem is None:
        return "counted"
    if "meta" in problem:
        return "named: meta tensor"
    return "named: a sum beyond float64" if "sum beyond" in problem else "named: NaN, infinite or negative"


def test_pipeline_counts_as_the_accumulator() -> None:
    """Each count: refused by the pipeline exactly when the accumulator refuses it, with the same message; the
    rest, each taken when given (a tensor overwritten after counts its value then), read to the same values
    (exact: no float32 rounding of 16777217.0 or 0.1), named by the same problem, summed to the same exact total;
    MicrobatchAccumulator.finish() over them refuses in those words or divides by that total. The steps drawn
    (COUNT_SEED) reach every class in CLASSES."""
    reached.clear()
    pipeline_counts()
    assert all(reached[c] > 0 for c in CLASSES), reached


def test_the_pipeline_names_a_count_in_the_accumulators_words() -> None:
    """Microbatch 1 of 3 counts NaN: the pipeline's problem is weight_problem's text, tagged as the loss function's
    counts; a loss function's own failure comes first (both are gathered to every rank by the step)."""
    pipe = Counts()
    losses = [torch.zeros((), requires_grad=True) for _ in range(3)]
    for loss, count in zip(losses, [4, float("nan"), torch.tensor(2)]):
        pipe.record(loss, count)
    pipe.keep(losses)
    assert pipe.read.values[0] == 4.0 and pipe.read.values[2] == 2.0
    assert pipe.problems() == [
        "the loss function's counts: microbatch 1 has weight nan: a weight must be finite and non-negative"]


def test_a_python_float_count_is_taken_exactly() -> None:
    """A count returned as a Python float is its float64 value (it was made a float32 tensor, torch's default
    dtype, before the pipeline shared the accumulator's check_weight: 16777217.0 counted 16777216, 0.1 counted
    0.10000000149, and 1e308 counted inf and was refused)."""
    pipe = Counts()
    losses = [torch.zeros((), requires_grad=True) for _ in range(3)]
    for loss, count in zip(losses, [16777217.0, 0.1, 1e308]):
        pipe.record(loss, count)
    pipe.keep(losses)
    assert local_tokens(pipe, True) == (16777217.0, 0.1, 1e308)


def test_counts_are_summed_exactly_and_rounded_once() -> None:
    """Ten counts of 0.1 total 1.0 and 1e16 + 1 + 1 totals 1e16 + 2 (a running float sum gives 0.9999999999999999
    and 1e16): the pipeline's total and the accumulator's divisor are the exact sum rounded once."""
    for counts in ([0.1] * 10, [1e16, 1.0, 1.0]):
        want = _total([(c, c) for c in counts])
        assert want in (1.0, 1e16 + 2)
        pipe = Counts()
        losses = [torch.zeros((), requires_grad=True) for _ in counts]
        for loss, c in zip(losses, counts):
            pipe.record(loss, c)
        pipe.keep(losses)
        assert pipe.read.total == want, (counts, pipe.read.total)
        _accumulator_agrees(counts, Read(tuple(counts), None, want))


def test_a_count_of_zero_counts_zero() -> None:
    """A microbatch counting 0 (every label masked) is no problem: it adds 0 to the total, which the others make
    (absent, zero and NaN are three things: only NaN is named)."""
    pipe = Counts()
    losses = [torch.zeros((), requires_grad=True) for _ in range(3)]
    for loss, count in zip(losses, [0, torch.tensor(0.0), 5]):
        pipe.record(loss, count)
    pipe.keep(losses)
    assert (pipe.read.problem, pipe.read.total, pipe.problems()) == (None, 5.0, [])
    _accumulator_agrees([0.0, 0.0, 5.0], Read((0.0, 0.0, 5.0), None, 5.0))


def test_a_fresh_or_cleared_record_holds_nothing() -> None:
    """Before any step and after clear(): no loss, no failure, no count, nothing to refuse; a loss the schedule
    cannot back-propagate (no gradient, or more than one element) is refused at record()."""
    pipe = Counts()
    for _ in range(2):
        assert (pipe.losses, pipe.failed, pipe.problems(), pipe.read.values, pipe.read.total) == ([], [], [], (), 0.0)
        pipe.record(torch.zeros((), requires_grad=True), 3)
        pipe.keep([])
        pipe.clear()
    for loss in (torch.zeros(()), torch.zeros(2, requires_grad=True), 1.0):
        with pytest.raises(GradaggError, match="the loss must be a one-element tensor with a gradient"):
            pipe.record(loss, 1)  # type: ignore[arg-type]


def test_failed_calls_are_named_by_their_microbatch_and_only_the_last_stage_counts() -> None:
    """A loss function call that failed is named by its microbatch in the schedule's order (a failure of a call the
    schedule did not keep, as the shape-inference one, is dropped); the kept losses are float64 scalars; a stage
    that is not the last has no counts to give."""
    pipe = Counts()
    good, bad, dropped = (torch.zeros((), requires_grad=True) for _ in range(3))
    pipe.record(good, 2)
    pipe.record_failure(bad, "ValueError: no labels")
    pipe.record_failure(dropped, "shape inference")
    pipe.keep([good, bad])
    assert pipe.failed == ["microbatch 1: ValueError: no labels"]
    assert [loss.dtype for loss in pipe.losses] == [torch.float64] and pipe.problems() == pipe.failed
    assert local_tokens(pipe, True) == (2.0,) and local_tokens(pipe, False) is None


def test_the_divisor_checks_hold_at_the_edges_of_the_dtype() -> None:
    """The largest finite and the smallest normal value of a dtype can divide its sums; beyond or below cannot; an
    int beyond float64 counts as an infinity of its sign (named by weight_problem)."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        finfo = torch.finfo(dtype)
        assert divisor_problem(finfo.max, dtype) is None and divisor_problem(finfo.tiny, dtype) is None, dtype
        assert divisor_problem(math.inf, dtype) is not None and divisor_problem(finfo.tiny / 2, dtype) is not None
    assert check_weight(10**400) == math.inf and check_weight(-(10**400)) == -math.inf


def test_a_loss_that_cannot_be_back_propagated_is_named_as_it_came() -> None:
    """record() of a loss with several elements, without a gradient, or not a tensor: the refusal shows what came."""
    for loss, shown in ((torch.ones(2, requires_grad=True), "shape (2,), requires_grad=True"),
                        (torch.ones(()), "shape (), requires_grad=False"), (1.5, "float")):
        with pytest.raises(GradaggError, match=rf"one-element tensor with a gradient, got {re.escape(shown)}$"):
            Counts().record(loss, 1)  # type: ignore[arg-type]
