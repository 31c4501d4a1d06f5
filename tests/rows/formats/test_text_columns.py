"""An owner-sum result given as its two columns (``results.Columns``), written as JSON, JSON Lines and CSV.

The oracle is the pairs path: ``json.dumps(list(zip(shards, totals)))`` and ``result_to_csv(pairs, "owner-sum")``
(repr per cell). The engines' columns are NumPy arrays (or lists). Without orjson the text must be the pairs'
text byte for byte: every float64 bit pattern (every NaN payload and sign, subnormals, -0.0, the ends of the
range, the switch from fixed to exponent notation at 1e16 and 1e-4), every int64. With orjson (finite numeric
columns only) the JSON and JSON Lines text is orjson's: read back, it must give the same values, type for type
and bit for bit.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradagg.errors import OutputError
from gradagg.rows.formats import results

FUZZ = settings(derandomize=True, deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])

INT64 = [0, 1, -1, 9, 10, -10, 2**31 - 1, -(2**31), 2**53 + 1, 10**18, 2**63 - 1, -(2**63), -(2**63) + 1]
FLOATS = [0.0, -0.0, 0.1, -2.5, 1.0, 5e-324, -5e-324, 2.2250738585072014e-308, 2.225073858507201e-308,
          1.7976931348623157e308, -1.7976931348623157e308, 1e16, 9999999999999998.0, 1e15, 1e-4, 9.999999999999999e-5,
          1e-5, 1e22, 1e23, 2.0**53, 2.0**53 + 2, 1 / 3, math.pi, math.inf, -math.inf, math.nan, -math.nan,
          struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0],  # a signalling NaN's payload
          struct.unpack("<d", struct.pack("<Q", 0xFFFFFFFFFFFFFFFF))[0]]  # a negative NaN, every payload bit


def any_float64() -> st.SearchStrategy[float]:
    """Every float64: listed edges, hypothesis' floats, and raw bit patterns (all NaN payloads, subnormals)."""
    bits = st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0])
    return st.one_of(st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True), bits)


int64s = st.one_of(st.sampled_from(INT64), st.integers(-(2**63), 2**63 - 1))


def oracle(pairs: list[tuple[Any, Any]]) -> tuple[str, str, str]:
    """The pairs path's JSON, JSON Lines and CSV of the same values as Python objects."""
    return (json.dumps(pairs) + "\n", "".join(json.dumps(p) + "\n" for p in pairs),
            results.result_to_csv(pairs, "owner-sum"))


def written(tmp_path: Path, shards: Any, totals: Any, *, orjson: bool = True) -> tuple[str, str, str]:
    """What the command line writes for these columns to out.json, out.jsonl and out.csv (orjson hidden or not)."""
    texts = []
    with pytest.MonkeyPatch.context() as mp:
        if not orjson:
            mp.setitem(sys.modules, "orjson", None)  # `import orjson` raises ImportError, as where it is missing
        for ext in ("json", "jsonl", "csv"):
            out = tmp_path / f"out.{ext}"
            results.write_owner_sum(str(out), shards, totals)
            texts.append(out.read_text(encoding="utf-8"))
    return texts[0], texts[1], texts[2]


def same_values(read: Any, pairs: list[tuple[Any, Any]]) -> bool:
    """Read-back pairs equal to ``pairs`` type for type and float bit for bit (a NaN, any payload, as a NaN)."""
    def same(a: Any, b: Any) -> bool:
        if type(a) is not type(b):
            return False
        if isinstance(a, float):
            return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)
        return bool(a == b)

    return len(read) == len(pairs) and all(same(a, x) and same(b, y) for (a, b), (x, y) in zip(read, pairs))


def read_back(texts: tuple[str, str, str]) -> tuple[Any, Any]:
    """The JSON and JSON Lines texts parsed as json parses them."""
    return json.loads(texts[0]), [json.loads(line) for line in texts[1].splitlines()]


@FUZZ
@given(st.lists(st.tuples(int64s, any_float64()), max_size=40))
def test_numpy_float_totals_are_the_pairs_text(tmp_path_factory: pytest.TempPathFactory,
                                               pairs: list[tuple[int, float]]) -> None:
    np = pytest.importorskip("numpy")
    shards = np.array([s for s, _ in pairs], dtype=np.int64)
    totals = np.array([t for _, t in pairs], dtype=np.float64)
    assert written(tmp_path_factory.mktemp("out"), shards, totals, orjson=False) == oracle(pairs)
    texts = written(tmp_path_factory.mktemp("out"), shards, totals)  # orjson's text where it is installed
    assert all(same_values(read, pairs) for read in read_back(texts)) and texts[2] == oracle(pairs)[2]


@FUZZ
@given(st.lists(st.tuples(int64s, int64s), max_size=40))
def test_numpy_int_totals_are_the_pairs_text(tmp_path_factory: pytest.TempPathFactory,
                                             pairs: list[tuple[int, int]]) -> None:
    np = pytest.importorskip("numpy")
    shards = np.array([s for s, _ in pairs], dtype=np.int64)
    totals = np.array([t for _, t in pairs], dtype=np.int64)
    assert written(tmp_path_factory.mktemp("out"), shards, totals, orjson=False) == oracle(pairs)
    texts = written(tmp_path_factory.mktemp("out"), shards, totals)
    assert all(same_values(read, pairs) for read in read_back(texts)) and texts[2] == oracle(pairs)[2]


def test_orjson_writes_finite_numeric_columns_only() -> None:
    """orjson takes NumPy integers and finite floats; NaN and infinity (which it would write as null), strings,
    lists and an absent orjson leave the text to json."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("orjson")
    ids, finite = np.array([1, 2, 3]), np.array([3.0, -0.0, 5e-324])
    edges = [3.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 1e16, 1e-5, 1e-7, 0.1]
    assert json.loads(results.orjson_text("json", np.array(edges)) or "") == edges
    assert [type(x) for x in json.loads(results.orjson_text("json", ids, finite) or "")[0]] == [int, float]
    assert results.orjson_text("jsonl", ids[:0], finite[:0]) == "" and results.orjson_text("json", ids[:0]) == "[]\n"
    for total in (math.nan, math.inf, -math.inf):
        assert results.orjson_text("json", ids, np.array([1.0, total, 2.0])) is None
    assert results.orjson_text("json", np.array(["x", "y", "z"]), finite) is None
    assert results.orjson_text("json", [1, 2, 3], finite) is None and results.orjson_text("csv", ids, finite) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "orjson", None)
        assert results.orjson_text("json", ids, finite) is None


def test_known_text(tmp_path: Path) -> None:
    """The spellings that a plausible wrong writer gets wrong: %.17g (0.1), inf vs Infinity, a missing .0."""
    np = pytest.importorskip("numpy")
    shards = np.array([-(2**63), 1, 3, 2**63 - 1, 5], dtype=np.int64)
    totals = np.array([math.nan, 0.1, -0.0, -math.inf, 1e16])  # (a NaN: json writes it, with or without orjson)
    as_json, _, as_csv = written(tmp_path, shards, totals)
    assert as_json == ("[[-9223372036854775808, NaN], [1, 0.1], [3, -0.0], [9223372036854775807, -Infinity], "
                       "[5, 1e+16]]\n")
    assert as_csv == "shard_id,total\n-9223372036854775808,nan\n1,0.1\n3,-0.0\n9223372036854775807,-inf\n5,1e+16\n"
    assert written(tmp_path, np.zeros(0, np.int64), np.zeros(0)) == ("[]\n", "", "shard_id,total\n")
    assert written(tmp_path, np.array([7]), np.array([3.0]))[0] in ("[[7, 3.0]]\n", "[[7,3.0]]\n")  # a float stays one


@pytest.mark.parametrize(
    ("shards", "totals"),
    [(["x", "a,b"], [1, [1.5, 2.0]]),                    # strings and vector totals: plain values
     ([1, 2], [0.5, math.nan]),                          # lists of numbers
     ([1, 2, 3], [0.5, 1.0])],                           # unequal lengths: zip's pairs, as before
)
def test_plain_columns_are_written_as_their_pairs(shards: Any, totals: Any) -> None:
    pairs = list(zip(shards, totals))
    columns = results.Columns(shards, totals)
    assert results.dumps_result(columns) == results.dumps_result(pairs)
    assert results.result_to_csv(columns, "owner-sum") == results.result_to_csv(pairs, "owner-sum")


def test_an_integer_too_long_to_write_is_the_same_error() -> None:
    big = 10 ** (4300 + 5)  # (built as a number: Python refuses only to write it as text)
    for fmt in ("json", "jsonl", "csv"):
        with pytest.raises(OutputError, match="the total of shard 'x' is an integer of about"):
            results.result_text(results.Columns(["x"], [big]), "owner-sum", fmt)
