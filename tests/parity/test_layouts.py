"""Layouts: parsed, checked against the window, and the defaults never hand two ranks the same data."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradagg.errors import GradaggError
from gradagg.parity.layouts import MAX_RANKS, check_layouts, default_layouts, parse_layout, rank_slice


@pytest.mark.parametrize(("text", "layout"), [("4", (4,)), ("1,3", (1, 3)), ("2,1,1", (2, 1, 1)), ("0,4", (0, 4))])
def test_the_issue_layouts_parse(text: str, layout: tuple[int, ...]) -> None:
    assert parse_layout(text) == layout


@pytest.mark.parametrize(("text", "message"), [
    ("1,x", "expected microbatch counts per rank"),
    ("", "expected microbatch counts per rank"),
    ("1,,3", "expected microbatch counts per rank"),
    ("2,-1", "cannot run -1 microbatches"),
    (",".join(["1"] * (MAX_RANKS + 1)), f"{MAX_RANKS + 1} ranks; at most {MAX_RANKS}"),
])
def test_bad_layout_text_is_an_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(GradaggError, match=message):
        parse_layout(text)


def test_a_layout_must_run_the_window_exactly_once() -> None:
    with pytest.raises(GradaggError, match=r"layout 1,2: the counts sum to 3, but microbatches\(\) returned 4"):
        check_layouts([(4,), (1, 2)], 4)
    with pytest.raises(GradaggError, match="at least one rank"):
        check_layouts([()], 4)


@given(st.integers(min_value=1, max_value=200))
def test_default_layouts_cover_the_window_on_one_and_two_ranks(window: int) -> None:
    """One process first, then two 2-rank splits whose rank 0 slices differ: one even (within 1), one uneven."""
    layouts = default_layouts(window)
    assert layouts[0] == (window,)
    assert all(sum(layout) == window for layout in layouts)
    assert [len(layout) for layout in layouts] == [1, 2, 2]
    even, uneven = layouts[1], layouts[2]
    assert abs(even[0] - even[1]) <= 1 and even != uneven


@given(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=MAX_RANKS))
def test_rank_slices_are_consecutive_and_disjoint(layout: list[int]) -> None:
    """Every microbatch goes to exactly one rank, in order: no two ranks ever see the same microbatch."""
    covered = [i for rank in range(len(layout)) for i in range(sum(layout))[rank_slice(tuple(layout), rank)]]
    assert covered == list(range(sum(layout)))
