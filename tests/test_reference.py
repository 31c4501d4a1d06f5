"""The pure-Python contracts: the case documents' 13 checks, the errors, and properties."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradagg
from gradagg import (
    GradaggError,
    GradientShapeError,
    GradientTypeError,
    IdError,
    NonFiniteGradientError,
    RowShapeError,
    UnorderableShardError,
    microbatch_mean,
    owner_sum,
)

N = 1

# --- the case documents, verbatim ------------------------------------------------

OWNER_SUM_DOCUMENT = [
    (
        "ignore replica copy",
        [["x", "a", "a", N], ["x", "b", "a", 9 * N], ["y", "c", "c", 2 * N]],
        [["x", N], ["y", 2 * N]],
    ),
    ("empty owners", [], []),
    ("only nonowner", [["z", "b", "a", N]], []),
    ("owner can be late", [["z", "b", "a", N], ["z", "a", "a", 3 * N]], [["z", 3 * N]]),
    ("several owners", [["b", "b", "b", N], ["a", "a", "a", 2 * N]], [["a", 2 * N], ["b", N]]),
    ("owner contributions add", [["q", "q", "q", N], ["q", "q", "q", 2 * N]], [["q", 3 * N]]),
]

MEAN_DOCUMENT = [
    ("missing treated as zero", [[2 * N, None], [4 * N, 6 * N]], [1, 2], [3 * N, 3 * N]),
    ("all present", [[2 * N, 4 * N], [6 * N, 8 * N]], [2, 2], [4 * N, 6 * N]),
    ("single missing", [[None, 5 * N]], [0, 1], [0, 5 * N]),
    ("empty rows", [], [], []),
    ("zero active count", [[0, None], [0, None]], [0, 0], [0, 0]),
    ("late participation", [[None, 2 * N], [9 * N, None], [3 * N, 4 * N]], [1, 1, 2], [4 * N, 2 * N]),
    ("zero gradient", [[0, None], [4 * N, 2 * N]], [1, 1], [2 * N, N]),
]


@pytest.mark.parametrize(("label", "rows", "expected"), OWNER_SUM_DOCUMENT, ids=[c[0] for c in OWNER_SUM_DOCUMENT])
def test_owner_sum_document_checks(label: str, rows: list, expected: list) -> None:
    assert owner_sum(rows) == expected


@pytest.mark.parametrize(("label", "rows", "counts", "expected"), MEAN_DOCUMENT, ids=[c[0] for c in MEAN_DOCUMENT])
def test_microbatch_mean_document_checks(label: str, rows: list, counts: list, expected: list) -> None:
    assert microbatch_mean(rows, counts) == expected


# --- behaviour beyond the documents ---------------------------------------------


def test_integer_totals_stay_exact_integers() -> None:
    """2**60 + 1 is not representable as a float; an int total must keep the 1."""
    result = owner_sum([["s", 0, 0, 2**60], ["s", 0, 0, 1]])
    assert result == [["s", 2**60 + 1]]
    assert type(result[0][1]) is int


def test_vector_gradients_add_elementwise_and_skip_replicas() -> None:
    rows = [["v", 0, 0, [1, 2]], ["v", 1, 0, [100, 100]], ["v", 0, 0, [3, 4]]]
    assert owner_sum(rows) == [["v", [4, 6]]]


def test_mean_is_float_and_divides_by_m() -> None:
    """[1, None, None]: the sum is 1 over M = 3 microbatches, not over 1 participation."""
    assert microbatch_mean([[1], [None], [None]]) == [pytest.approx(1 / 3, abs=0)]


def test_nan_propagates_by_default_and_is_not_absence() -> None:
    [[_, total]] = owner_sum([["n", 0, 0, float("nan")], ["n", 0, 0, 1.0]])
    assert math.isnan(total)
    mean = microbatch_mean([[float("nan"), None]])
    assert math.isnan(mean[0]) and mean[1] == 0.0


def test_nan_in_replica_row_is_not_counted_even_in_raise_mode() -> None:
    assert owner_sum([["n", 1, 0, float("nan")], ["n", 0, 0, 2.0]], nonfinite="raise") == [["n", 2.0]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), [1.0, float("-inf")]])
def test_nonfinite_raise_names_row_and_shard(bad: object) -> None:
    with pytest.raises(NonFiniteGradientError, match=r"row 1: gradient of shard 's'"):
        owner_sum([["s", 0, 0, [0.0, 0.0] if isinstance(bad, list) else 0.0], ["s", 0, 0, bad]], nonfinite="raise")


def test_mean_nonfinite_raise_names_microbatch_and_parameter() -> None:
    with pytest.raises(NonFiniteGradientError, match=r"microbatch 1, parameter 0 is inf"):
        microbatch_mean([[1.0], [float("inf")]], nonfinite="raise")


def test_bad_nonfinite_option() -> None:
    with pytest.raises(GradaggError, match="nonfinite must be"):
        owner_sum([], nonfinite="ignore")  # type: ignore[arg-type]


# --- errors: every class named by the foundation issue ----------------------------

ERROR_CASES = [
    (
        "row of wrong length",
        lambda: owner_sum([["x", "a", "a", 1], ["x", "a", "a"]]),
        RowShapeError,
        r"row 1: expected 4 fields .* got 3",
    ),
    ("row that is not a list", lambda: owner_sum(["xaa1"]), RowShapeError, r"row 0: expected a list"),
    (
        "string gradient",
        lambda: owner_sum([["x", "a", "a", "1"]]),
        GradientTypeError,
        r"row 0: gradient must be a number .* got str '1'",
    ),
    ("boolean gradient", lambda: owner_sum([["x", "a", "a", True]]), GradientTypeError, r"row 0: .* got bool True"),
    (
        "boolean in a vector",
        lambda: owner_sum([["x", "a", "a", [1, False]]]),
        GradientTypeError,
        r"row 0: gradient element 1 must be a number, got bool False",
    ),
    (
        "vector lengths differ",
        lambda: owner_sum([["x", 0, 0, [1, 2]], ["x", 1, 0, [1, 2, 3]]]),
        GradientShapeError,
        r"row 1: gradient of shard 'x' is a vector of length 3, expected a vector of length 2 \(from row 0\)",
    ),
    (
        "scalar meets vector",
        lambda: owner_sum([["x", 0, 0, 1], ["x", 0, 0, [1]]]),
        GradientShapeError,
        r"row 1: .* is a vector of length 1, expected a scalar \(from row 0\)",
    ),
    ("None shard id", lambda: owner_sum([[None, "a", "a", 1]]), IdError, r"row 0: shard_id is missing \(None\)"),
    ("None worker id", lambda: owner_sum([["x", None, "a", 1]]), IdError, r"row 0: worker_id is missing"),
    (
        "None owner id",
        lambda: owner_sum([["x", "a", "a", 1], ["x", "a", None, 1]]),
        IdError,
        r"row 1: owner_id is missing",
    ),
    ("float id", lambda: owner_sum([[1.5, "a", "a", 1]]), IdError, r"row 0: shard_id must be an int or a string"),
    (
        "unorderable shard ids",
        lambda: owner_sum([[1, 0, 0, 1], ["a", 0, 0, 1]]),
        UnorderableShardError,
        r"shard ids 1 \(row 0, int\) and 'a' \(row 1, str\) cannot be ordered",
    ),
    (
        "ragged microbatch",
        lambda: microbatch_mean([[1, 2], [1, 2, 3]]),
        RowShapeError,
        r"microbatch 1: has 3 values, expected 2 \(from microbatch 0\)",
    ),
    (
        "string microbatch value",
        lambda: microbatch_mean([[1, "2"]]),
        GradientTypeError,
        r"microbatch 0, parameter 1: value must be a number or None",
    ),
    (
        "negative active count",
        lambda: microbatch_mean([[1]], [-1]),
        GradientTypeError,
        r"active_counts\[0\] must be a non-negative integer, got -1",
    ),
]


@pytest.mark.parametrize(("label", "call", "error", "pattern"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_name_where_and_what(label: str, call, error: type, pattern: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=pattern) as info:
        call()
    assert isinstance(info.value, GradaggError) and isinstance(info.value, ValueError)


def test_unorderable_pair_is_found_even_when_only_replicas_mix_types() -> None:
    """Replica rows do not appear in the result, so their id types cannot break the sort."""
    assert owner_sum([[1, 0, 0, 1], ["a", 1, 0, 1]]) == [[1, 1]]


# --- properties against a brute-force model ------------------------------------------


def brute_owner_sum(rows: list) -> list:
    owned = sorted({r[0] for r in rows if r[1] == r[2]})
    return [[s, sum(r[3] for r in rows if r[0] == s and r[1] == r[2])] for s in owned]


shard_ids = st.sampled_from(["a", "b", "c", "d"])
worker_ids = st.integers(0, 3)
owner_rows = st.lists(st.tuples(shard_ids, worker_ids, worker_ids, st.integers(-(10**6), 10**6)).map(list), max_size=30)


@settings(max_examples=200, deadline=None)
@given(owner_rows, st.randoms(use_true_random=False))
def test_owner_sum_matches_brute_force_and_ignores_order(rows: list, rnd: random.Random) -> None:
    """Integer gradients, so every order of the rows must give exactly the same totals."""
    expected = brute_owner_sum(rows)
    shuffled = rows[:]
    rnd.shuffle(shuffled)
    assert owner_sum(rows) == expected
    assert owner_sum(shuffled) == expected


@settings(max_examples=200, deadline=None)
@given(owner_rows, st.lists(st.tuples(shard_ids, worker_ids, worker_ids, st.integers()), max_size=10))
def test_adding_nonowner_rows_never_changes_the_result(rows: list, extra: list) -> None:
    replicas = [[s, w, o, g] for s, w, o, g in extra if w != o]
    assert owner_sum(rows + replicas) == owner_sum(rows) == owner_sum(replicas + rows)


@settings(max_examples=200, deadline=None)
@given(owner_rows, st.integers(-(10**6), 10**6))
def test_splitting_an_owner_gradient_over_two_rows_keeps_the_total(rows: list, part: int) -> None:
    owned = [r for r in rows if r[1] == r[2]]
    if not owned:
        return
    s, w, o, g = owned[0]
    split = [r for r in rows if r is not owned[0]] + [[s, w, o, part], [s, w, o, g - part]]
    assert owner_sum(split) == owner_sum(rows)


values = st.one_of(st.none(), st.integers(-1000, 1000))


@st.composite
def microbatches(draw: st.DrawFn) -> list:
    m, p = draw(st.integers(1, 8)), draw(st.integers(0, 6))
    return [[draw(values) for _ in range(p)] for _ in range(m)]


@settings(max_examples=200, deadline=None)
@given(microbatches())
def test_mean_times_m_equals_column_sums(rows: list) -> None:
    """Integer inputs below 2**53: sum / M * M recovers the sum to within one rounding (a relative 2**-52)."""
    m = len(rows)
    for j, mean in enumerate(microbatch_mean(rows)):
        column_sum = sum(r[j] or 0 for r in rows)
        assert mean * m == pytest.approx(column_sum, rel=2**-50, abs=0)


@settings(max_examples=200, deadline=None)
@given(microbatches())
def test_absent_and_explicit_zero_give_the_same_mean(rows: list) -> None:
    zeros = [[0 if v is None else v for v in r] for r in rows]
    assert microbatch_mean(rows) == microbatch_mean(zeros)


@settings(max_examples=100, deadline=None)
@given(microbatches(), st.lists(st.integers(0, 50), max_size=8))
def test_active_counts_never_change_the_mean(rows: list, counts: list) -> None:
    assert microbatch_mean(rows, counts) == microbatch_mean(rows)


def test_public_api_is_small() -> None:
    assert callable(gradagg.owner_sum) and callable(gradagg.microbatch_mean)
    assert issubclass(gradagg.GradaggError, ValueError)
