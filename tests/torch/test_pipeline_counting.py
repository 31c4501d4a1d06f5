"""One counting (issue 24): the pipeline's last stage takes, checks and sums its counts as the accumulator does.

One process, no world: :class:`gradagg.torch.pipeline.counts.Counts` (what ``PipelineAccumulator.loss`` records)
against :mod:`gradagg.torch.accumulate.counting` (what ``MicrobatchAccumulator`` counts with) and against
``MicrobatchAccumulator.finish()`` itself, over counts drawn from what a hostile loss function returns: floats
anywhere in float64 (NaN, Inf, negative, huge), ints beyond float64, tensors of several dtypes (on the meta device
too), and what is not one real number. The expected values are computed here, independently. The step's refusal
on every rank, in these words, is tests/torch/test_pipeline.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import hypothesis.strategies as st
import torch
from hypothesis import given, seed, settings

from gradagg.errors import GradaggError, WindowError
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.accumulate.counting import Read, Tally
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


@seed(COUNT_SEED)
@settings(max_examples=150, deadline=None)
@given(counts=st.lists(COUNTS, min_size=1, max_size=5))
def test_pipeline_counts_as_the_accumulator(counts: list[object]) -> None:
    """Each count: refused by the pipeline exactly when the accumulator refuses it, with the same message; the
    rest, each taken when given (a tensor overwritten after counts its value then), read to the same values
    (exact: no float32 rounding of 16777217.0 or 0.1), named by the same problem, summed to the same exact total;
    MicrobatchAccumulator.finish() over them refuses in those words or divides by that total."""
    pipe, tally, losses, kept = Counts(), Tally(), [], []
    for c in counts:
        loss = torch.zeros((), requires_grad=True)
        as_weight = c.reshape(()) if isinstance(c, torch.Tensor) and c.numel() == 1 else c  # what differs
        refused = _raised(pipe.record, loss, c)
        assert refused == _raised(tally.add, as_weight), (c, refused)
        if refused is None:
            losses.append(loss)
            kept.append((as_weight.clone() if isinstance(as_weight, torch.Tensor) else as_weight, _value(c)))
            if isinstance(c, torch.Tensor) and not c.is_meta:
                c.fill_(7)  # a count tensor the loss function reuses: each microbatch counted its value when given
    pipe.keep(losses)
    want = tally.read()
    assert _same(pipe.read.values, want.values) and _same(pipe.read.values, tuple(v for _, v in kept)), counts
    assert pipe.read.problem == want.problem, (pipe.read, want)
    assert want.problem is not None or pipe.read.total == want.total == math.fsum(v for _, v in kept)
    assert (pipe.problems() != []) == (want.problem is not None)
    if kept:  # none: no microbatch to compare (the accumulator's M = 0 is its own refusal)
        _accumulator_agrees([w for w, _ in kept], want)


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
