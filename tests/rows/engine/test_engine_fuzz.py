"""Every engine against the reference on generated inputs at the edges of their types, one-shot and in batches.

Inputs (see :mod:`fuzz`): int ids at the int64 bounds and around 2**53, string
ids that differ only by trailing NULs, empty, non-BMP, a lone surrogate, 300
characters; gradients -0.0, NaN, +-inf, subnormals, 1e308, ints, vectors of
width 1 to 3; microbatches with absent values, ints beyond 2**53. Each engine
(numpy, torch, python, chosen by ``engine=``) must give the reference's answer bit for bit, as NumPy
arrays, lists or torch tensors, in one call and fed in batches; with
``nonfinite="raise"`` it must raise exactly when the reference does, with the
same message.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradagg import reference
from gradagg.errors import GradaggError, NonFiniteGradientError, RowShapeError
from gradagg.rows.engine import (
    ColumnarMean,
    ColumnarOwnerSum,
    microbatch_mean_batches,
    microbatch_mean_columns,
    microbatch_mean_rows,
    owner_sum_columns,
    owner_sum_rows,
    python_values,
)
from tests.rows.engine.engine_inputs import FUZZ, IMPLS, bits, messy_rows, microbatch_rows, owner_rows, variant

# every engine by name, and "auto" as each input kind resolves it (CPU tensors: the NumPy kernels, viewed)
CHOICES = (*IMPLS, "auto")
KINDS = ["numpy", "unicode", "list", "torch", "float32"]  # unicode: string ids as <U arrays (no trailing NULs)


def outcome(fn: Any, *args: Any, **kw: Any) -> Any:
    """The result's bits, or the class and message of the GradaggError raised."""
    try:
        return bits(fn(*args, **kw))
    except GradaggError as exc:
        return (type(exc).__name__, str(exc))


# --- owner-sum ---------------------------------------------------------------------------------------


def columns_of(rows: list[list[Any]], kind: str) -> tuple[Any, ...]:
    """The rows as four columns of one input kind (strings always host-side: object arrays or lists)."""
    cols = [[r[k] for r in rows] for k in range(4)]
    if kind == "list":
        return tuple(cols)
    out: list[Any] = []
    for k, col in enumerate(cols):
        if k < 3:
            is_str = bool(col) and isinstance(col[0], str)
            a = np.array(col, dtype=str if kind == "unicode" else object) if is_str else np.array(col, dtype=np.int64)
            out.append(torch.from_numpy(a) if kind == "torch" and not is_str else a)
            continue
        is_int = bool(col) and not isinstance(col[0], list) and isinstance(col[0], int)
        g = np.array(col, dtype=np.int64 if is_int else np.float64).reshape(len(col), *np.shape(col)[1:])
        if kind == "float32" and not is_int:
            with np.errstate(over="ignore"):  # 1e308 is inf in float32: a value like any other
                g = g.astype(np.float32)
        out.append(torch.from_numpy(g) if kind == "torch" else g)
    return tuple(out)


def rows_of(columns: tuple[Any, ...]) -> list[list[Any]]:
    """What the reference sees: the columns' own values (float32 widened exactly, as the engines sum them)."""
    return [list(r) for r in zip(*(python_values(c) for c in columns))]


def pairs(result: tuple[Any, Any]) -> list[list[Any]]:
    return [[s, t] for s, t in zip(python_values(result[0]), python_values(result[1]))]


def fed(engine: str, columns: tuple[Any, ...], cuts: list[int]) -> list[list[Any]]:
    acc = ColumnarOwnerSum(engine=engine)
    bounds = [0, *cuts, len(columns[0])]
    for lo, hi in zip(bounds, bounds[1:]):
        acc.update(*(c[lo:hi] for c in columns))
    return pairs(acc.result())


@FUZZ
@given(rows=owner_rows(), nonfinite=st.sampled_from(["propagate", "raise"]))
def test_owner_sum_rows_equal_the_reference(rows: list[list[Any]], nonfinite: str) -> None:
    """owner_sum_rows on every engine: the reference's pairs (exact int totals stay ints), or its very error."""
    want = outcome(reference.owner_sum, rows, nonfinite=nonfinite)
    for impl in CHOICES:
        with variant(impl) as engine:
            assert outcome(owner_sum_rows, rows, engine=engine, nonfinite=nonfinite) == want, impl


@FUZZ
@given(rows=owner_rows(), kind=st.sampled_from(KINDS), cuts=st.lists(st.integers(0, 30), max_size=3))
def test_owner_sum_columns_equal_the_reference(rows: list[list[Any]], kind: str, cuts: list[int]) -> None:
    """NumPy arrays, lists, tensors and float32: one call and any split into batches give the reference's bits."""
    columns = columns_of(rows, kind)
    want = bits(reference.owner_sum(rows_of(columns)))
    cuts = sorted(min(c, len(rows)) for c in cuts)
    for impl in CHOICES:
        with variant(impl) as engine:
            assert bits(pairs(owner_sum_columns(*columns, engine=engine))) == want, impl
            assert bits(fed(engine, columns, cuts)) == want, (impl, cuts)


@FUZZ
@given(rows=owner_rows(vectors=False), kind=st.sampled_from(["numpy", "torch"]))
def test_owner_sum_nonfinite_raise_names_what_the_reference_names(rows: list[list[Any]], kind: str) -> None:
    """With nonfinite="raise" an engine raises exactly when the reference does, with the same message."""
    columns = columns_of(rows, kind)
    try:
        reference.owner_sum(rows_of(columns), nonfinite="raise")
        want = None
    except NonFiniteGradientError as exc:
        want = str(exc)
    for impl in CHOICES:
        with variant(impl) as engine:
            try:
                owner_sum_columns(*columns, engine=engine, nonfinite="raise")
                got = None
            except NonFiniteGradientError as exc:
                got = str(exc)
        assert got == want, impl


# --- microbatch mean ---------------------------------------------------------------------------------


def mean_arrays(rows: list[list[Any]]) -> tuple[np.ndarray, np.ndarray]:
    shape = (len(rows), len(rows[0]) if rows else 0)
    present = np.array([[v is not None for v in r] for r in rows], dtype=bool).reshape(shape)
    flat = [v for r in rows for v in r if v is not None]
    dtype = np.int64 if flat and all(isinstance(v, int) for v in flat) else np.float64
    values = np.array([[0 if v is None else v for v in r] for r in rows], dtype=dtype).reshape(present.shape)
    return values, present


def allowed(rows: list[list[Any]], got: Any) -> bool:
    """An engine may refuse integers a float64 sum would round, saying so; nothing else."""
    big = any(isinstance(v, int) and abs(v) > 2**53 for r in rows for v in r)
    return big and isinstance(got, tuple) and got[0] == "GradaggError" and "2**53" in got[1]


@FUZZ
@given(rows=microbatch_rows(), counts=st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=6)))
def test_microbatch_mean_rows_equal_the_reference(rows: list[list[Any]], counts: list[int] | None) -> None:
    """The rows API: the reference's means, or a clear refusal of ints a float64 sum would round."""
    want = outcome(reference.microbatch_mean, rows, counts)
    for impl in CHOICES:
        with variant(impl) as engine:
            got = outcome(microbatch_mean_rows, rows, counts, engine=engine)
        assert got == want or allowed(rows, got), impl


@FUZZ
@given(rows=microbatch_rows(), torch_input=st.booleans(), cut=st.integers(0, 6), pcut=st.integers(0, 5))
def test_microbatch_mean_columns_equal_the_reference(rows: list[list[Any]], torch_input: bool, cut: int,
                                                     pcut: int) -> None:
    """(M, P) values and mask, int64 or float64, NumPy or torch: one call, microbatches fed in two batches, and
    parameters in two batches (the Parquet layout) all give the reference's bits."""
    values, present = mean_arrays(rows)
    want = bits(reference.microbatch_mean(rows))
    v, p = (torch.from_numpy(values), torch.from_numpy(present)) if torch_input else (values, present)
    cut, pcut = min(cut, len(rows)), min(pcut, values.shape[1])
    for impl in CHOICES:
        with variant(impl) as engine:
            assert bits(python_values(microbatch_mean_columns(v, p, engine=engine))) == want, impl
            if rows:
                acc = ColumnarMean(engine=engine)
                acc.update(v[:cut], p[:cut])
                acc.update(v[cut:], p[cut:])
                assert bits(python_values(acc.result())) == want, (impl, "microbatches in batches")
                halves = [(v[:, :pcut], p[:, :pcut]), (v[:, pcut:], p[:, pcut:])]
                assert bits(python_values(microbatch_mean_batches(halves, engine=engine))) == want, impl


# --- edges that deserve their own line -----------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_ids_differing_by_trailing_nul_stay_apart(impl: str) -> None:
    """'a' and 'a\\0' are two shards, and worker 'w\\0' is not owner 'w': the row is a replica, never counted."""
    rows = [["a", "w", "w", 1.0], ["a\x00", "w", "w", 2.0], ["a", "w\x00", "w", 4.0]]
    assert reference.owner_sum(rows) == [["a", 1.0], ["a\x00", 2.0]]
    for kind in ("numpy", "list"):
        with variant(impl) as engine:
            assert pairs(owner_sum_columns(*columns_of(rows, kind), engine=engine)) == [["a", 1.0], ["a\x00", 2.0]]
            assert owner_sum_rows(rows, engine=engine) == [["a", 1.0], ["a\x00", 2.0]]


@pytest.mark.parametrize("impl", IMPLS)
def test_exact_integers_beyond_2_53_beside_floats(impl: str) -> None:
    """The issue's rows: x's gradients are all ints, so its total is the exact int 2**53 + 2, not a float."""
    rows = [["x", "a", "a", 1], ["y", "a", "a", 0.5], ["x", "a", "a", 2**53 + 1]]
    with variant(impl) as engine:
        assert owner_sum_rows(rows, engine=engine) == [["x", 2**53 + 2], ["y", 0.5]]
        assert bits(owner_sum_rows(rows, engine=engine)) == bits(reference.owner_sum(rows))
        if engine != "python":  # a float64 column cannot hold both; rounding silently is never an answer
            with pytest.raises(GradaggError, match=r"2\*\*53"):
                owner_sum_columns(*zip(*rows), engine=engine)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("value", [2**64, 2**63, -(2**63) - 1, 10**30])
def test_integers_beyond_int64(impl: str, value: int) -> None:
    """As ids they are exact Python keys on every engine (the reference's answer); as gradients a fixed-width
    engine cannot sum them, and says so naming the value (python sums them exactly). Never a traceback."""
    rows = [[value, value, value, 1.0], [1, 0, 0, 2.0], [value, 0, 0, 4.0]]
    with variant(impl) as engine:
        want = sorted([[1, 2.0], [value, 5.0]])
        assert pairs(owner_sum_columns(*([r[k] for r in rows] for k in range(4)), engine=engine)) == want
        assert owner_sum_rows(rows, engine=engine) == reference.owner_sum(rows)
        if engine == "python":
            assert owner_sum_rows([[1, 0, 0, value], [1, 0, 0, 1]], engine=engine) == [[1, value + 1]]
            return
        with pytest.raises(GradaggError, match=f"{value}.*beyond int64"):
            owner_sum_columns([1], [0], [0], [value], engine=engine)
        with pytest.raises(GradaggError, match=f"{value}.*beyond int64"):
            owner_sum_rows([[1, 0, 0, value]], engine=engine)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_column_of_width_one_vectors(impl: str) -> None:
    """10^4 rows of (N, 1) gradients: the same as the scalar column, element for element."""
    rng = np.random.default_rng(5)
    shards, owners = rng.integers(0, 50, 10_000), rng.integers(0, 2, 10_000)
    workers, g = np.zeros(10_000, np.int64), rng.standard_normal(10_000) * 10.0 ** rng.integers(-5, 5, 10_000)
    with variant(impl) as engine:
        s, t = owner_sum_columns(shards, workers, owners, g[:, None], engine=engine)
        s1, t1 = owner_sum_columns(shards, workers, owners, g, engine=engine)
    assert python_values(s) == python_values(s1) and bits(python_values(t)) == bits([[x] for x in python_values(t1)])


# --- malformed input: the reference's error, or a GradaggError naming an engine limit; never another exception --


@FUZZ
@given(rows=messy_rows())
def test_malformed_rows_fail_as_the_reference_fails(rows: list[Any]) -> None:
    """owner_sum_rows refuses what the reference refuses, with its message, unless an engine limit (naming
    engine='python') comes first in row order: the reference is then re-read only up to that row, not run
    again on all of them; columns of the same values raise only GradaggError (a TypeError or RecursionError
    here would be a traceback on the command line)."""
    want = outcome(reference.owner_sum, rows)
    for impl in CHOICES:
        with variant(impl) as engine:
            got = outcome(owner_sum_rows, rows, engine=engine)
            limit = isinstance(got, tuple) and "engine='python'" in got[1]
            assert got == want or limit, impl
            if all(isinstance(r, list) and len(r) == 4 for r in rows):
                outcome(owner_sum_columns, *([r[k] for r in rows] for k in range(4)), engine=engine)


@pytest.mark.parametrize("impl", IMPLS)
def test_ids_at_both_int64_bounds(impl: str) -> None:
    """2**63 - 1 then -2**63: the dense table must not wrap (shard - lo overflowed int64 and merged them)."""
    rows = [[2**63 - 1, 0, 0, 1.0], [0, 0, 1, 5.0], [-(2**63), 0, 0, 2.0], [2**63 - 2, 0, 0, 4.0]]
    with variant(impl) as engine:
        got = pairs(owner_sum_columns(*(np.array([r[k] for r in rows]) for k in range(4)), engine=engine))
    assert got == reference.owner_sum(rows) == [[-(2**63), 2.0], [2**63 - 2, 4.0], [2**63 - 1, 1.0]]


# --- the columnar API on lists: exact Python ints, and masks of another shape ---------------------------------

BIG_INTS = [2**63, 2**63 - 1, -(2**63), -(2**63) - 1, 2**64, 3, -5, 2**70, 0]


@FUZZ
@given(gradients=st.lists(st.lists(st.sampled_from(BIG_INTS), min_size=1, max_size=4), min_size=1, max_size=3),
       ids=st.lists(st.sampled_from([0, 1, 2**63]), min_size=12, max_size=12))
def test_integer_lists_are_exact_on_python_and_exact_or_refused_elsewhere(gradients: list[list[int]],
                                                                          ids: list[int]) -> None:
    """Integer gradients in plain lists, some beyond int64: engine="python" gives the reference's exact ints;
    numpy and torch give the same ints or refuse by name (int64), never a float."""
    flat = [g for batch in gradients for g in batch]
    shards = ids[: len(flat)]
    want = reference.owner_sum([[s, 0, 0, g] for s, g in zip(shards, flat)])
    for engine in IMPLS:
        try:
            got = pairs(owner_sum_columns(shards, [0] * len(flat), [0] * len(flat), flat, engine=engine))
        except GradaggError as exc:
            assert engine != "python" and "int64" in str(exc), (engine, str(exc))
            continue
        assert bits(got) == bits(want), engine


@FUZZ
@given(values_shape=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       mask_shape=st.one_of(st.tuples(st.integers(0, 3), st.integers(0, 3)), st.tuples(st.integers(0, 3))),
       as_lists=st.booleans())
def test_a_mask_is_refused_by_every_engine_exactly_when_its_shape_differs(
    values_shape: tuple[int, int], mask_shape: tuple[int, ...], as_lists: bool
) -> None:
    """values (M, P) and a present mask: each engine's mean when the shapes match (the reference's), a
    RowShapeError from every engine when they do not."""
    values, present = np.ones(values_shape), np.ones(mask_shape, dtype=bool)
    args: tuple[Any, Any] = (values.tolist(), present.tolist()) if as_lists else (values, present)
    same = np.shape(args[0]) == np.shape(args[1])  # ([] is as much (0, 0) as (0,))
    for engine in IMPLS:
        if same:
            means = python_values(microbatch_mean_columns(*args, engine=engine))
            assert [float(m) for m in means] == [1.0] * len(means) and len(means) in (0, values_shape[1]), engine
            continue
        with pytest.raises(RowShapeError):
            microbatch_mean_columns(*args, engine=engine)
