"""The pure-Python contracts: the case documents' 13 checks, the errors, and properties."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gradagg import (
    GradaggError,
    GradientShapeError,
    GradientTypeError,
    IdError,
    NonFiniteGradientError,
    NumberRangeError,
    RowShapeError,
    UnorderableShardError,
    microbatch_mean,
    owner_sum,
)
from gradagg.verify import Case

# --- the case documents, verbatim (defined once in gradagg.verify; fixtures in conftest.py) -------------


def test_owner_sum_document_checks(owner_sum_document_case: Case) -> None:
    label, (rows,), expected = owner_sum_document_case
    assert owner_sum(rows) == expected, label


def test_microbatch_mean_document_checks(microbatch_mean_document_case: Case) -> None:
    label, (rows, counts), expected = microbatch_mean_document_case
    assert microbatch_mean(rows, counts) == expected, label


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
        "microbatch that is not a list",
        lambda: microbatch_mean([[1.0], 2.0]),
        RowShapeError,
        r"microbatch 1: expected a list of values, got 2\.0",
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
    (
        "active_counts given as text",
        lambda: microbatch_mean([[1]], "1"),
        GradientTypeError,
        r"active_counts must be a list of integers, got '1'",
    ),
    (
        "an active count that is a bool",
        lambda: microbatch_mean([[1]], [True]),
        GradientTypeError,
        r"active_counts\[0\] must be a non-negative integer, got True",
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


@settings(max_examples=200, deadline=None, derandomize=True)
@given(owner_rows, st.randoms(use_true_random=False))
def test_owner_sum_matches_brute_force_and_ignores_order(rows: list, rnd: random.Random) -> None:
    """Integer gradients, so every order of the rows must give exactly the same totals."""
    expected = brute_owner_sum(rows)
    shuffled = rows[:]
    rnd.shuffle(shuffled)
    assert owner_sum(rows) == expected
    assert owner_sum(shuffled) == expected


@settings(max_examples=200, deadline=None, derandomize=True)
@given(owner_rows, st.lists(st.tuples(shard_ids, worker_ids, worker_ids, st.integers()), max_size=10))
def test_adding_nonowner_rows_never_changes_the_result(rows: list, extra: list) -> None:
    replicas = [[s, w, o, g] for s, w, o, g in extra if w != o]
    assert owner_sum(rows + replicas) == owner_sum(rows) == owner_sum(replicas + rows)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(owner_rows, st.integers(-(10**6), 10**6))
def test_splitting_an_owner_gradient_over_two_rows_keeps_the_total(rows: list, part: int) -> None:
    owned = [r for r in rows if r[1] == r[2]]
    assume(owned)
    s, w, o, g = owned[0]
    split = [r for r in rows if r is not owned[0]] + [[s, w, o, part], [s, w, o, g - part]]
    assert owner_sum(split) == owner_sum(rows)


values = st.one_of(st.none(), st.integers(-1000, 1000))


@st.composite
def microbatches(draw: st.DrawFn) -> list:
    m, p = draw(st.integers(1, 8)), draw(st.integers(0, 6))
    return [[draw(values) for _ in range(p)] for _ in range(m)]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(microbatches())
def test_mean_times_m_equals_column_sums(rows: list) -> None:
    """Integer inputs below 2**53: sum / M * M recovers the sum to within one rounding (a relative 2**-52)."""
    m = len(rows)
    for j, mean in enumerate(microbatch_mean(rows)):
        column_sum = sum(r[j] or 0 for r in rows)
        assert mean * m == pytest.approx(column_sum, rel=2**-50, abs=0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(microbatches())
def test_absent_and_explicit_zero_give_the_same_mean(rows: list) -> None:
    zeros = [[0 if v is None else v for v in r] for r in rows]
    assert microbatch_mean(rows) == microbatch_mean(zeros)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(microbatches(), st.lists(st.integers(0, 50), max_size=8))
def test_active_counts_never_change_the_mean(rows: list, counts: list) -> None:
    assert microbatch_mean(rows, counts) == microbatch_mean(rows)


# --- numbers at the edges: a clear error, never OverflowError or ValueError from Python -------------------


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: owner_sum([["x", 0, 0, 10**400], ["x", 0, 0, 0.5]]),
         r"row 1: adding gradient 0.5 to the total of shard 'x' \(<an int of about 401 digits>\) overflows a float"),
        (lambda: owner_sum([["x", 0, 0, 0.5], ["x", 0, 0, 10**400]]), r"row 1: adding gradient <an int of about 401"),
        (lambda: owner_sum([["v", 0, 0, [1, 10**400]], ["v", 0, 0, [1, 0.5]]]),
         r"row 1: adding gradient element 1 0.5 to the total of shard 'v' \(<an int of about 401 digits>\)"),
        (lambda: microbatch_mean([[10**400]]),
         r"parameter 0: the sum <an int of about 401 digits> over M = 1 microbatches is too large for a float"),
        (lambda: microbatch_mean([[10**400], [0.5]]), r"microbatch 1, parameter 0: adding 0.5 to the sum"),
    ],
)
def test_values_a_float_cannot_hold_are_errors(call, pattern: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NumberRangeError, match=pattern):
        call()


def test_a_big_integer_mean_that_fits_a_float_is_correctly_rounded() -> None:
    """(10**309 + 10**309) / 20 = 10**308: Python's int / int rounds once, so no overflow and no error."""
    assert microbatch_mean([[10**309], [10**309]] + [[None]] * 18) == [1e308]


def test_an_integer_too_long_to_print_is_described_not_printed() -> None:
    with pytest.raises(GradientTypeError, match=r"active_counts\[0\] .* got <an int of about 5001 digits>"):
        microbatch_mean([[1]], [-(10**5000)])


def test_rows_that_are_not_a_list_are_an_error() -> None:
    with pytest.raises(RowShapeError, match="rows must be a list of rows, got None"):
        owner_sum(None)  # type: ignore[arg-type]
    with pytest.raises(RowShapeError, match="rows must be a list of microbatches, got 'ab'"):
        microbatch_mean("ab")  # type: ignore[arg-type]


edge_numbers = st.one_of(
    st.integers(-(10**400), 10**400),
    st.sampled_from([2**53 + 1, -(2**63), 2**64, 10**308, 10**309]),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 1), edge_numbers), max_size=8))
def test_owner_sum_on_edge_numbers_returns_or_raises_a_gradagg_error(rows: list) -> None:
    """Any mix of huge ints and floats: the exact Python sum, or NumberRangeError; never a bare OverflowError."""
    full = [[s, w, 0, g] for s, w, g in rows]
    expected: dict[str, object] = {}
    try:  # plain Python, row by row: what the contract says, or the OverflowError it cannot avoid
        for s, w, g in rows:
            if w == 0:
                expected[s] = g if s not in expected else expected[s] + g  # type: ignore[operator]
    except OverflowError:
        with pytest.raises(NumberRangeError):  # the same input must be refused, by name, not crash
            owner_sum(full)
        return
    result = owner_sum(full)
    assert [s for s, _ in result] == sorted(expected)
    for shard, total in result:
        want = expected[shard]
        assert total == want or (math.isnan(total) and math.isnan(want))  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.one_of(st.none(), edge_numbers), min_size=2, max_size=2), min_size=1, max_size=6))
def test_microbatch_mean_on_edge_numbers_returns_floats_or_raises_a_gradagg_error(rows: list) -> None:
    try:  # plain Python: the column sums over M, or the OverflowError it cannot avoid
        want = [sum(0 if r[j] is None else r[j] for r in rows) / len(rows) for j in range(2)]
    except OverflowError:
        with pytest.raises(NumberRangeError):
            microbatch_mean(rows)
        return
    means = microbatch_mean(rows)
    assert all(type(m) is float for m in means)
    assert all(m == w or (math.isnan(m) and math.isnan(w)) for m, w in zip(means, want))
