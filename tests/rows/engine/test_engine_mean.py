"""Microbatch-mean engines against the reference: absent is explicit, NaN is a value, the divisor is M.

Each parameter's sum adds its present values microbatch by microbatch from
+0.0, as the reference does from ``0``; the means are compared bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from gradagg import mutants, reference
from gradagg.errors import GradientShapeError, GradientTypeError, NonFiniteGradientError, RowShapeError
from gradagg.rows.engine import ColumnarMean, microbatch_mean_columns
from tests.rows.engine.engine_inputs import IMPLS, NUMPY_LIKE


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    name = request.param
    yield name


def run(impl: str, values: np.ndarray, present: np.ndarray | None, **kw: Any) -> np.ndarray:
    engine = impl.split("-")[0]
    if engine == "torch":
        out = microbatch_mean_columns(
            torch.from_numpy(values), None if present is None else torch.from_numpy(present), engine=engine, **kw
        )
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
        return np.asarray(out.numpy())
    return np.asarray(microbatch_mean_columns(values, present, engine=engine, **kw))


def reference_of(values: np.ndarray, present: np.ndarray | None) -> list[float]:
    mask = np.ones(values.shape, bool) if present is None else present
    rows = [[v if p else None for v, p in zip(vr, pr)] for vr, pr in zip(values.tolist(), mask.tolist())]
    return reference.microbatch_mean(rows)


def assert_bits(got: np.ndarray, want: list[float], why: str) -> None:
    assert got.shape == (len(want),), why
    assert np.array_equal(got.view(np.int64), np.asarray(want, dtype=np.float64).view(np.int64)), why


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (3, 17), (8, 5000)])
def test_random_inputs_match_reference(impl: str, dtype: Any, shape: tuple[int, int]) -> None:
    """Seeded values over many magnitudes, 10% absent: the reference's means, bit for bit."""
    for seed in range(2):
        rng = np.random.default_rng(seed)
        values = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6, shape) * 1000).astype(dtype)
        present = rng.random(shape) >= 0.1
        want = reference_of(values, present)
        if shape[0] == 0:
            assert run(impl, values, present).shape == (0,)  # the reference: [] when there are no microbatches
            continue
        assert_bits(run(impl, values, present), want, f"seed={seed} dtype={dtype} shape={shape}")
        assert_bits(run(impl, values, None), reference_of(values, None), f"seed={seed} all present")


def test_large_input_takes_the_threaded_path(impl: str) -> None:
    """P large enough to split columns across threads (>= 2**22 values) still matches bit for bit."""
    if impl == "python":
        pytest.skip("the reference on 4 Mi values takes seconds; the threaded path is a fast-engine matter")
    rng = np.random.default_rng(7)
    values = rng.standard_normal((2, 1 << 21), dtype=np.float32)
    present = rng.random((2, 1 << 21)) >= 0.1
    want = (np.where(present[0], values[0], 0).astype(np.float64) + np.where(present[1], values[1], 0)) / 2
    assert np.array_equal(run(impl, values, present), want)


def test_absent_nan_is_ignored_present_nan_propagates(impl: str) -> None:
    """NaN is a value: absent NaN contributes nothing; a present NaN makes the mean NaN."""
    values = np.array([[np.nan, np.nan], [4.0, 6.0]])
    present = np.array([[False, True], [True, True]])
    got = run(impl, values, present)
    assert got[0] == 2.0 and np.isnan(got[1])
    with pytest.raises(NonFiniteGradientError, match=r"microbatch 0, parameter 1 is nan"):
        run(impl, values, present, nonfinite="raise")


def test_divisor_is_m_and_mutants_differ(impl: str) -> None:
    """[[2, absent], [4, 6]] with counters [1, 2]: (2+4)/2 and 6/2, i.e. [3, 3]; the wrong divisors differ."""
    values = np.array([[2.0, 0.0], [4.0, 6.0]])
    present = np.array([[True, False], [True, True]])
    assert run(impl, values, present).tolist() == [3.0, 3.0]
    rows: list[list[Any]] = [[2.0, None], [4.0, 6.0]]
    assert mutants.divide_by_active_counts(rows, [1, 2]) != [3.0, 3.0]
    assert mutants.divide_by_participation(rows, [1, 2]) != [3.0, 3.0]


def test_accumulator_in_batches_equals_one_shot(impl: str) -> None:
    """Feeding microbatches one or several at a time gives the same bits; the divisor counts them all."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((5, 40))
    present = rng.random((5, 40)) >= 0.3
    acc = ColumnarMean(engine=impl.split("-")[0])
    for lo, hi in ((0, 1), (1, 4), (4, 5)):
        v, p = values[lo:hi], present[lo:hi]
        acc.update(*((torch.from_numpy(v), torch.from_numpy(p)) if impl.startswith("torch") else (v, p)))
    got = acc.result()
    assert_bits(np.asarray(got.numpy() if isinstance(got, torch.Tensor) else got), reference_of(values, present), "")
    with pytest.raises(RowShapeError, match="microbatch 5: has 3 values, expected 40"):
        acc.update(*((torch.zeros(1, 3),) if impl.startswith("torch") else (np.zeros((1, 3)),)))


def test_accumulator_refuses_a_batch_of_another_numeric_kind(impl: str) -> None:
    """Integer sums are exact, float sums are float64: a batch that switches kind is named, never silently cast.

    The reference itself adds Python ints and floats as Python does, so the python engine gives its answer.
    """
    acc = ColumnarMean(engine=impl.split("-")[0])
    ints, floats = np.array([[1, 2]], dtype=np.int64), np.array([[0.5, 1.5]])
    wrap = torch.from_numpy if impl.startswith("torch") else (lambda a: a)
    acc.update(wrap(ints))
    if impl == "python":
        acc.update(floats)
        assert acc.result().tolist() == reference.microbatch_mean([[1, 2], [0.5, 1.5]]) == [0.75, 1.75]
        return
    with pytest.raises(GradientTypeError, match=r"microbatch 1: values are .*float64 here but .*int64 sums before"):
        acc.update(wrap(floats))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_list_of_tensors_form(kind: str) -> None:
    """Per-parameter tensors with None for absent: mean over M=2; a never-present parameter is a 0-d zero."""
    make = torch.tensor if kind == "torch" else np.array
    rows = [[make([1.0, 2.0]), None, None], [make([3.0, 4.0]), make(5.0), None]]
    means = microbatch_mean_columns(rows)
    assert [m.tolist() for m in means] == [[2.0, 3.0], 2.5, 0.0]
    assert type(means[0]) is type(make(0.0))
    with pytest.raises(GradientShapeError, match="microbatch 1, parameter 0: shape"):
        microbatch_mean_columns([[make([1.0])], [make([1.0, 2.0])]])


def test_python_scalars_in_lists_match_reference() -> None:
    """The reference's own input form runs through every engine choice."""
    rows: list[list[Any]] = [[2, None], [4, 6]]
    assert [float(x) for x in microbatch_mean_columns(rows)] == reference.microbatch_mean(rows)


@pytest.mark.parametrize(
    "values, present, error, match",
    [
        (np.zeros(3), None, RowShapeError, r"shape \(M, P\)"),
        (np.zeros((2, 3), bool), None, GradientTypeError, "bool"),
        (np.zeros((2, 3)), np.ones((2, 3), np.int64), GradientTypeError, "boolean mask"),
        (np.zeros((2, 3)), np.ones((2, 4), bool), RowShapeError, r"present has shape \(2, 4\)"),
    ],
)
def test_bad_input_is_named(values: np.ndarray, present: Any, error: type[Exception], match: str) -> None:
    for engine in (*NUMPY_LIKE, "torch"):
        v = torch.from_numpy(values) if engine == "torch" else values
        p = torch.from_numpy(present) if engine == "torch" and present is not None else present
        with pytest.raises(error, match=match):
            microbatch_mean_columns(v, p, engine=engine)
