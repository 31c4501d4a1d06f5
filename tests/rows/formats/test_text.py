"""The text readers: what each cell and line means (gradagg.rows.formats.text, _csv, _json)."""

from __future__ import annotations

import csv
import math

import pytest

from gradagg.errors import FormatError
from gradagg.rows.formats import text


def csv_mean(body: str, header: bool | None = None) -> list:
    return text.read_microbatches(body, "csv", "m.csv", header=header)[0]


# --- CSV numbers: one strict grammar, exact integers ------------------------------------------------------


@pytest.mark.parametrize(
    ("cell", "value"),
    [("7", 7), ("-7", -7), ("+7", 7), ("007", 7), ("-0", 0), ("9007199254740993", 2**53 + 1), ("1.5", 1.5),
     ("-.5", -0.5), ("1.", 1.0), ("1e-3", 0.001), ("2E+2", 200.0), ("-0.0", -0.0), (" 3 ", 3), ("inf", math.inf),
     ("-Infinity", -math.inf), ("+INF", math.inf), ("1e-400", 0.0)],
)
def test_csv_numbers(cell: str, value: float) -> None:
    """Integer literals stay exact ints (2**53 + 1 is not rounded); 1e-400 underflows to 0.0 like any float parser."""
    [[got]] = csv_mean(cell + "\n", header=False)
    assert got == value and type(got) is type(value) and math.copysign(1, got) == math.copysign(1, value)


def test_csv_nan_is_a_value() -> None:
    [[a], [b]] = csv_mean("nan\n-NaN\n", header=False)
    assert math.isnan(a) and math.isnan(b)


@pytest.mark.parametrize("cell", ["1_000", "١", "0x10", "1e", "++1", "+-inf", "nan1", "1,5", "--1", "infinit"])
def test_csv_cells_that_are_not_numbers(cell: str) -> None:
    """Python's float() takes '1_000' and Arabic-Indic digits; a CSV number is ASCII decimal only."""
    with pytest.raises(FormatError, match="expected a number or an empty cell"):
        csv_mean(f'"{cell}"\n', header=False)


# --- CSV structure -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "rows"),
    [
        ("a,b\n1,2\n", [[1, 2]]),  # every cell a name: a header
        ("1,2\n3,\n", [[1, 2], [3, None]]),  # every cell a number or empty: data
        (",\n1,2\n", [[None, None], [1, 2]]),  # an all-absent first microbatch is data, not a header
        ("nan,inf\n1,2\n", [[math.nan, math.inf], [1, 2]]),  # nan and inf are numbers
        ("a,b\n", []),  # a header alone: no microbatch
        ("\n", [[None]]),  # one blank line: one microbatch, one absent value
        ('"x\ny",z\n1,2\n', [[1, 2]]),  # a quoted name over two lines is one header record
    ],
)
def test_csv_header_rule(body: str, rows: list) -> None:
    got = csv_mean(body)
    assert repr(got) == repr(rows)


@pytest.mark.parametrize("first", ["1,abc", "a,", ",b", "x,1,y"])
def test_csv_ambiguous_first_line_is_an_error(first: str) -> None:
    with pytest.raises(FormatError, match="line 1: cannot tell a header from a microbatch.*--header.*--no-header"):
        csv_mean(first + "\n" + ",".join("1" * len(first.split(","))) + "\n")


def test_csv_errors_name_the_line_a_record_starts_on() -> None:
    with pytest.raises(FormatError, match=r"line 3 \(microbatch 1\), parameter 0: expected a number"):
        csv_mean('a\n1\n"x\ny"\n')
    with pytest.raises(FormatError, match="line 2: invalid CSV: unexpected end of data"):
        csv_mean('1\n"2\n')


def test_the_csv_field_limit_is_restored_after_reading() -> None:
    before = csv.field_size_limit()
    assert text.read_owner_rows("shard_id,worker_id,owner_id,gradient\n" + "s" * 200_000 + ",0,0,1\n", "csv")
    assert csv.field_size_limit() == before


def test_owner_csv_cells() -> None:
    body = 'shard_id,worker_id,owner_id,gradient\n7,a,,"[1, 2.5]"\n-3,007,x y,-0.0\n'
    assert text.read_owner_rows(body, "csv") == [[7, "a", None, [1, 2.5]], [-3, "007", "x y", -0.0]]


# --- JSON and JSON Lines ---------------------------------------------------------------------------------


def test_json_lines_accept_crlf_and_keep_unicode_line_separators_inside_strings() -> None:
    """Only \\n ends a JSON Lines line: U+2028 is a legal character inside a JSON string."""
    body = '["a\u2028b", 0, 0, 1]\r\n["c", 0, 0, 2]\r\n'
    assert text.read_owner_rows(body, "jsonl") == [["a\u2028b", 0, 0, 1], ["c", 0, 0, 2]]


def test_json_infinity_literals_stay_allowed_but_overflow_is_not() -> None:
    rows, _ = text.read_microbatches("[[Infinity, -Infinity, NaN]]", "json")
    assert rows[0][:2] == [math.inf, -math.inf] and math.isnan(rows[0][2])
    with pytest.raises(FormatError, match="line 2 column 2: number '-1e999' is too large"):
        text.read_microbatches("[[1],\n[-1e999]]", "json")


def test_json_escaped_lone_surrogates_are_read_as_they_are() -> None:
    assert text.read_owner_rows('[["\\ud800", 0, 0, 1]]', "json") == [["\ud800", 0, 0, 1]]
