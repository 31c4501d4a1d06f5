"""Writing results: every output format's text, and where it goes (gradagg.rows.formats.results)."""

from __future__ import annotations

import pytest

from gradagg.errors import OutputError
from gradagg.rows.formats import results


def test_output_format_by_extension() -> None:
    assert [results.output_format(p) for p in ("a.json", "a.JSONL", "a.ndjson", "a.csv", "a.parquet", "a.txt",
                                                "/dev/stdout", None)] == [
        "json", "jsonl", "jsonl", "csv", "parquet", "json", "json", "json"]


def test_csv_output_cells() -> None:
    assert results.result_to_csv([["", 1], [" a", float("nan")], ["q", [1, -0.0]]], "owner-sum") == (
        'shard_id,total\n"",1\n" a",nan\nq,"[1, -0.0]"\n')
    assert results.result_to_csv([0.5, float("-inf")], "microbatch-mean") == "parameter,mean\n0,0.5\n1,-inf\n"


def test_output_that_python_cannot_write() -> None:
    with pytest.raises(OutputError, match="shard 'x' is an integer of about 4301 digits"):
        results.dumps_result([["x", 10**4300]])
    with pytest.raises(OutputError, match="out.csv: cannot write CSV: line 1 holds the lone surrogate U[+]DC00"):
        results.encode_csv("\udc00", "out.csv")
