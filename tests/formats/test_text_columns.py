"""An owner-sum result given as its two columns (``text.Columns``), written as JSON and CSV.

The oracle is the pairs path: ``dumps_result(list(zip(shards, totals)))`` (json.dumps) and
``result_to_csv(pairs, "owner-sum")`` (repr per cell). Columns of plain values take that path itself;
the native backend's ``array.array`` columns (``"q"`` shards, ``"d"`` or ``"q"`` totals) are written in C
(``gradagg._native._pairtext``) and must give the same text byte for byte: every float64 bit pattern
(every NaN payload and sign, subnormals, -0.0, the ends of the range, the switch from fixed to exponent
notation at 1e16 and 1e-4), every int64. The command line takes the C path for a Parquet file on the
native path, and writes the same bytes with it as with ``GRADAGG_NATIVE=0``, to stdout, ``.json`` and ``.csv``.
"""

from __future__ import annotations

import json
import math
import struct
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradagg._native import load
from gradagg.errors import OutputError
from gradagg.formats import text

C = load("_pairtext")
needs_c = pytest.mark.skipif(C is None, reason="the C text writer _pairtext is not built (or GRADAGG_NATIVE=0)")
FUZZ = settings(derandomize=True, deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])

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


def oracle(shards: array[int], totals: array[Any]) -> tuple[str, str]:
    """The pairs path's JSON and CSV of the same values as Python objects."""
    pairs = list(zip(shards.tolist(), totals.tolist()))
    return json.dumps(pairs), text.result_to_csv(pairs, "owner-sum")


def written(shards: Any, totals: Any) -> tuple[str, str]:
    columns = text.Columns(shards, totals)
    return text.dumps_result(columns), text.result_to_csv(columns, "owner-sum")


# --- the C writer against json.dumps and repr -------------------------------------------------------------------


@needs_c
@FUZZ
@given(st.lists(st.tuples(int64s, any_float64()), max_size=40))
def test_float_totals_are_json_dumps_byte_for_byte(pairs: list[tuple[int, float]]) -> None:
    shards, totals = array("q", [s for s, _ in pairs]), array("d", [t for _, t in pairs])
    assert written(shards, totals) == oracle(shards, totals)


@needs_c
@FUZZ
@given(st.lists(st.tuples(int64s, int64s), max_size=40))
def test_int_totals_are_json_dumps_byte_for_byte(pairs: list[tuple[int, int]]) -> None:
    shards, totals = array("q", [s for s, _ in pairs]), array("q", [t for _, t in pairs])
    assert written(shards, totals) == oracle(shards, totals)


@needs_c
def test_every_listed_edge_at_once() -> None:
    """All the edges in one result (the buffer grows past its first 4 KiB), floats and then ints as totals."""
    shards = array("q", [INT64[k % len(INT64)] for k in range(400)])
    for totals in (array("d", [FLOATS[k % len(FLOATS)] for k in range(400)]), array("q", shards[::-1])):
        assert written(shards, totals) == oracle(shards, totals)


@needs_c
def test_known_text() -> None:
    """The spellings that a plausible wrong writer gets wrong: %.17g (0.1), inf vs Infinity, a missing .0."""
    shards = array("q", [-(2**63), 1, 3, 2**63 - 1, 5])
    totals = array("d", [math.nan, 0.1, -0.0, -math.inf, 1e16])
    assert C is not None
    assert C.pairs_text(shards, totals, False) == ("[[-9223372036854775808, NaN], [1, 0.1], [3, -0.0], "
                                                   "[9223372036854775807, -Infinity], [5, 1e+16]]")
    assert C.pairs_text(shards, totals, True) == ("-9223372036854775808,nan\n1,0.1\n3,-0.0\n"
                                                  "9223372036854775807,-inf\n5,1e+16\n")
    assert C.pairs_text(array("q", [7]), array("q", [-(2**63)]), False) == "[[7, -9223372036854775808]]"
    assert C.pairs_text(array("q"), array("d"), False) == "[]" and C.pairs_text(array("q"), array("d"), True) == ""
    assert written(array("q"), array("d")) == ("[]", "shard_id,total\n")


@needs_c
@pytest.mark.parametrize(
    ("shards", "totals", "error", "fragment"),
    [(array("i", [1]), array("d", [1.0]), TypeError, "shards: a buffer of format i"),
     (array("q", [1]), array("f", [1.0]), TypeError, "totals: a buffer of format f"),
     (memoryview(bytes(8)), array("d", [1.0]), TypeError, "format B"),
     (array("q", [1, 2]), array("d", [1.0]), ValueError, "shards has 2 values but totals 1"),
     (array("q", [1]), [1.0], TypeError, "bytes-like object is required")],
)
def test_the_c_writer_refuses_other_buffers(shards: Any, totals: Any, error: type, fragment: str) -> None:
    assert C is not None
    with pytest.raises(error, match=fragment):
        C.pairs_text(shards, totals, False)


@pytest.fixture
def c_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The ``csv`` argument of every call of the C writer during the test."""
    calls: list[bool] = []
    real = C.pairs_text  # type: ignore[union-attr]

    def spy(shards: Any, totals: Any, csv: bool) -> str:
        calls.append(csv)
        return real(shards, totals, csv)  # type: ignore[no-any-return]

    monkeypatch.setattr(C, "pairs_text", spy)
    return calls


@needs_c
def test_array_columns_take_the_c_path(c_calls: list[bool]) -> None:
    """Fails if the C writer is built but text quietly writes array columns through json and repr instead."""
    assert written(array("q", [2]), array("d", [0.5])) == ("[[2, 0.5]]", "shard_id,total\n2,0.5\n")
    assert c_calls == [False, True]


# --- what stays on the pairs path ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shards", "totals"),
    [(["x", "a,b"], [1, [1.5, 2.0]]),                    # strings and vector totals: plain values
     ([1, 2], [0.5, math.nan]),                          # lists of numbers
     (array("q", [1, 2]), array("f", [0.5, 0.1])),       # float32 buffers (repr of the widened float)
     (array("l", [1, 2]), array("d", [0.5, 1.0])),       # another integer typecode
     (array("q", [1, 2, 3]), array("d", [0.5, 1.0]))],   # unequal lengths: zip's pairs, as before
)
def test_other_columns_are_written_as_their_pairs(shards: Any, totals: Any) -> None:
    pairs = list(zip(shards, totals))
    assert written(shards, totals) == (text.dumps_result(pairs), text.result_to_csv(pairs, "owner-sum"))


def test_an_integer_too_long_to_write_is_the_same_error() -> None:
    big = 10 ** (4300 + 5)  # (built as a number: Python refuses only to write it as text)
    with pytest.raises(OutputError, match="the total of shard 'x' is an integer of about"):
        text.dumps_result(text.Columns(["x"], [big]))


# --- the command line -------------------------------------------------------------------------------------------


def parquet_rows(tmp_path: Path, gradient_type: str) -> str:
    """Int64 shards over the whole int64 range and every edge total; ~half the rows are the owner's."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = 3000
    shards = [INT64[k % len(INT64)] if k % 3 else (k * 7919) % 2001 - 1000 for k in range(n)]
    owners = [k % 4 for k in range(n)]
    workers = [o if k % 2 else (o + 1) % 4 for k, o in enumerate(owners)]
    if gradient_type == "float64":
        grads: list[Any] = [FLOATS[k % len(FLOATS)] if k % 5 == 0 else k / 7 - 200 for k in range(n)]
    else:
        grads = [k % 11 - 5 for k in range(n)]
    path = tmp_path / f"rows_{gradient_type}.parquet"
    table = pa.table({"shard_id": pa.array(shards, pa.int64()), "worker_id": pa.array(workers, pa.int32()),
                      "owner_id": pa.array(owners, pa.int32()),
                      "gradient": pa.array(grads, getattr(pa, gradient_type)())})
    pq.write_table(table, path)
    return str(path)


def outputs(cli: Any, path: str, tmp_path: Path, label: str) -> tuple[str, bytes, bytes]:
    """stdout, then the bytes of -o out.json and -o out.csv."""
    printed = cli("owner-sum", path, "-q").ok()
    files = []
    for ext in ("json", "csv"):
        out = tmp_path / f"{label}.{ext}"
        cli("owner-sum", path, "-q", "-o", str(out)).ok()
        files.append(out.read_bytes())
    return printed, files[0], files[1]


@needs_c
@pytest.mark.parametrize("gradient_type", ["float64", "int64"])
def test_the_command_writes_the_same_bytes_natively(tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch,
                                                    c_calls: list[bool], gradient_type: str) -> None:
    """Native (the C writer, checked to run three times) and GRADAGG_NATIVE=0 (pyarrow, NumPy, json): same bytes."""
    if load("_ownersum") is None or load("_pqdecode") is None:
        pytest.skip("the native Parquet path (_pqdecode, _ownersum) is not built")
    path = parquet_rows(tmp_path, gradient_type)
    native = outputs(cli, path, tmp_path, "native")
    assert c_calls == [False, False, True]  # stdout, .json, .csv
    monkeypatch.setenv("GRADAGG_NATIVE", "0")
    pure = outputs(cli, path, tmp_path, "pure")
    assert c_calls == [False, False, True]  # (not called again)
    assert native == pure
    assert native[0].startswith("[[-9223372036854775808, ") and native[1] == native[0].encode("ascii")
    assert native[2].startswith(b"shard_id,total\n-9223372036854775808,")
