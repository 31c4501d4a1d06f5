"""gradagg.formats.parquet_native_write: the pure-Python owner-sum writer against pyarrow's writer and readers.

Every result it takes (``array("q")`` shards, ``array("d")`` or ``array("q")`` totals) is read back by
pyarrow, by gradagg's own native decoder and (where installed) by DuckDB and Polars as exactly the values
written, bit for bit (NaN payloads, -0.0, infinities, int64's extremes), with the schema pyarrow's writer
(:func:`gradagg.formats.parquet.write_owner_sum`) gives the same result; anything else it hands back
(False, nothing written). Then the command line: ``-o OUT.parquet`` after a natively read input writes
through it without importing pyarrow, the same file as with ``GRADAGG_NATIVE=0`` as a reader sees it,
and a failure keeps the old OUT.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.formats.parquet_files import read_footer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gradagg.formats import _parquet_meta, parquet_native, parquet_native_write  # noqa: E402
from gradagg.formats import parquet as pyarrow_writer  # noqa: E402  (after the importorskips)

needs_native = pytest.mark.skipif(parquet_native.load("_pqdecode") is None or parquet_native.load("_ownersum") is None,
                                  reason="the native extensions are not built (or GRADAGG_NATIVE=0)")
FUZZ = settings(derandomize=True, deadline=None, max_examples=60,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF0_0000_0000_0ABC))[0]  # a signalling NaN's bits
SPECIAL = [0.0, -0.0, 1.5, 5e-324, -1e308, math.inf, -math.inf, math.nan, -math.nan, NAN_PAYLOAD]
INT64_EDGES = [-(2**63), -(2**63) + 1, -1, 0, 1, 2**53 + 1, 2**63 - 1]


def bits(values: Any) -> bytes:
    """The values' bytes: NaN payloads and the sign of zero compare too."""
    return values.tobytes() if isinstance(values, array) else bytes(values)


def pyarrow_columns(path: Path) -> tuple[bytes, bytes, Any]:
    """``shard_id`` and ``total`` as pyarrow reads them (raw bytes), and the table's schema."""
    table = pq.read_table(path)
    assert table.column_names == ["shard_id", "total"]
    raw = [b"".join(_values(c) for c in table.column(name).chunks) for name in ("shard_id", "total")]
    for name in table.column_names:
        assert table.column(name).null_count == 0
    return raw[0], raw[1], table.schema


def _values(chunk: Any) -> bytes:
    """An int64 or float64 Arrow array's values as bytes (its buffer may be longer, or absent when empty)."""
    buffer = chunk.buffers()[1]
    return b"" if buffer is None else buffer.to_pybytes()[8 * chunk.offset : 8 * (chunk.offset + len(chunk))]


def native_columns(path: Path) -> tuple[bytes, bytes]:
    """``shard_id`` and ``total`` decoded by gradagg's own reader (footer plan and C decoder), as raw bytes."""
    decoder = parquet_native.load("_pqdecode")
    source = parquet_native._Source.open(str(path))
    assert decoder is not None and source is not None
    footer = _parquet_meta.read_footer(source.read_at, source.size)
    plan = _parquet_meta.plan_columns(footer, ["shard_id", "total"],
                                      [{_parquet_meta.INT64}, {_parquet_meta.INT64, _parquet_meta.DOUBLE}])
    parts: list[list[bytes]] = [[], []]
    try:
        for _, columns in parquet_native._Decoding(decoder, source, plan).batches(slots=(0, 1)):
            for k, column in enumerate(columns):
                assert column.indices is None  # plain pages only
                parts[k].append(column.values.tobytes())
    finally:
        source.close()
    return b"".join(parts[0]), b"".join(parts[1])


def write_both(tmp_path: Path, shards: array[int], totals: array[Any]) -> tuple[Path, Path]:
    ours, theirs = tmp_path / "native.parquet", tmp_path / "pyarrow.parquet"
    assert parquet_native_write.write_owner_sum(str(ours), shards, totals) is True
    pyarrow_writer.write_owner_sum(str(theirs), shards, totals)
    return ours, theirs


def assert_same_as_pyarrows_writer(tmp_path: Path, shards: array[int], totals: array[Any]) -> Path:
    """The native writer's file and pyarrow's writer's for one result: same schema, same values bit for bit."""
    ours, theirs = write_both(tmp_path, shards, totals)
    got, want = pyarrow_columns(ours), pyarrow_columns(theirs)
    assert got[:2] == want[:2] == (bits(shards), bits(totals))
    assert got[2].equals(want[2], check_metadata=True)
    assert pq.read_schema(ours).equals(pq.read_schema(theirs), check_metadata=True)
    assert pq.ParquetFile(ours).schema.equals(pq.ParquetFile(theirs).schema)  # the Parquet schema: OPTIONAL, types
    return ours


@pytest.mark.parametrize("kind", ["d", "q"])
def test_edge_values_read_back_bit_for_bit_with_pyarrows_schema(tmp_path: Path, kind: str) -> None:
    """int64's extremes as ids; -0.0, NaNs (with a payload), infinities, a subnormal, 2**53 + 1 as totals."""
    shards = array("q", INT64_EDGES + list(range(10, 13)))
    totals = array(kind, SPECIAL if kind == "d" else INT64_EDGES[::-1] + [7, 8, 9])
    path = assert_same_as_pyarrows_writer(tmp_path, shards, totals)
    want = pa.int64() if kind == "q" else pa.float64()
    assert pq.read_schema(path).field("total").type == want and pq.read_schema(path).field("total").nullable


def test_the_footer_is_sane(tmp_path: Path) -> None:
    """10 rows: one row group of 10, both columns PLAIN uncompressed, statistics a null count of 0 and no min/max."""
    path = tmp_path / "out.parquet"
    parquet_native_write.write_owner_sum(str(path), array("q", range(10)), array("d", [0.5] * 10))
    meta = pq.ParquetFile(path).metadata
    assert (meta.num_rows, meta.num_row_groups, meta.num_columns) == (10, 1, 2)
    assert meta.created_by.startswith("gradagg version ")
    for k in range(2):
        chunk = meta.row_group(0).column(k)
        assert chunk.num_values == 10 and chunk.compression == "UNCOMPRESSED" and set(chunk.encodings) == {
            "PLAIN", "RLE"}
        assert chunk.is_stats_set and chunk.statistics.null_count == 0 and not chunk.statistics.has_min_max
    assert meta.row_group(0).num_rows == 10
    _, footer = read_footer(path)  # the fields pyarrow does not show: RowGroup's file_offset, sizes, ordinal
    group, chunks = footer[4][0], [c[3] for c in footer[4][0][1]]
    assert group[5] == chunks[0][9] == 4 and chunks[1][9] == chunks[0][9] + chunks[0][7]
    assert group[2] == group[6] == sum(c[7] for c in chunks) == path.stat().st_size - 12 - int.from_bytes(
        path.read_bytes()[-8:-4], "little") and group[7] == 0


@pytest.mark.parametrize("kind", ["d", "q"])
def test_an_empty_result_is_a_file_of_no_row_group_with_the_same_schema(tmp_path: Path, kind: str) -> None:
    """No shard: zero rows, and ``total`` float64 for ``array("d")`` (as pyarrow's writer now writes it too)."""
    path = assert_same_as_pyarrows_writer(tmp_path, array("q"), array(kind))
    assert pq.ParquetFile(path).metadata.num_row_groups == 0 and pq.read_table(path).num_rows == 0
    assert pq.read_schema(path).field("total").type == (pa.float64() if kind == "d" else pa.int64())


def test_a_large_result_spans_row_groups_and_pages(tmp_path: Path) -> None:
    """GROUP_ROWS + 5 rows at the real sizes: 2 row groups (the second of 5 rows), 9 pages in the first."""
    n = parquet_native_write.GROUP_ROWS + 5
    shards = array("q", range(-3, n - 3))
    totals = array("d", bytes(8 * n))
    totals[-1], totals[parquet_native_write.PAGE_ROWS] = -0.0, math.nan
    path = assert_same_as_pyarrows_writer(tmp_path, shards, totals)
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(k).num_rows for k in range(meta.num_row_groups)] == [n - 5, 5]


@needs_native
def test_gradagg_reads_it_back_natively(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gradagg's own footer plan takes the file (OPTIONAL columns, null count 0) and decodes every value."""
    monkeypatch.setattr(parquet_native_write, "PAGE_ROWS", 7)
    monkeypatch.setattr(parquet_native_write, "GROUP_ROWS", 20)
    shards = array("q", INT64_EDGES * 7)
    totals = array("d", (SPECIAL * 5)[: len(shards)])
    path = tmp_path / "out.parquet"
    parquet_native_write.write_owner_sum(str(path), shards, totals)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    assert native_columns(path) == (bits(shards), bits(totals))


@FUZZ
@given(st.data(), st.sampled_from(["d", "q"]), st.sampled_from([1, 3, 64]), st.sampled_from([2, 5, 1000]))
def test_random_results_round_trip(tmp_path_factory: Any, monkeypatch: pytest.MonkeyPatch, data: Any, kind: str,
                                   page_rows: int, group_rows: int) -> None:
    """Random ids and totals, small pages and row groups: every reader gets the values written, bit for bit."""
    monkeypatch.setattr(parquet_native_write, "PAGE_ROWS", page_rows)
    monkeypatch.setattr(parquet_native_write, "GROUP_ROWS", group_rows)
    ints = st.integers(-(2**63), 2**63 - 1)
    n = data.draw(st.integers(0, 150), label="n")
    shards = array("q", data.draw(st.lists(ints, min_size=n, max_size=n), label="shards"))
    values = st.floats(width=64) | st.sampled_from(SPECIAL) if kind == "d" else ints
    totals = array(kind, data.draw(st.lists(values, min_size=n, max_size=n), label="totals"))
    tmp = tmp_path_factory.mktemp("random")
    path = assert_same_as_pyarrows_writer(tmp, shards, totals)
    assert pq.ParquetFile(path).metadata.num_row_groups == -(-n // group_rows)
    if parquet_native.load("_pqdecode") is not None:
        assert native_columns(path) == (bits(shards), bits(totals))


def test_duckdb_and_polars_read_it(tmp_path: Path) -> None:
    """DuckDB (BIGINT, DOUBLE) and Polars (Int64, Float64), where installed, read the values written."""
    shards, totals = array("q", [-(2**63), 0, 2**63 - 1]), array("d", [-0.0, math.inf, 2.5])
    path = tmp_path / "out.parquet"
    parquet_native_write.write_owner_sum(str(path), shards, totals)
    readers = 0
    try:
        import duckdb
    except ImportError:
        duckdb = None
    if duckdb is not None:
        relation = duckdb.sql(f"SELECT shard_id, total FROM read_parquet('{path}')")
        assert [str(t) for t in relation.types] == ["BIGINT", "DOUBLE"]
        rows = relation.fetchall()
        assert [r[0] for r in rows] == list(shards) and bits(array("d", [r[1] for r in rows])) == bits(totals)
        readers += 1
    try:
        import polars
    except ImportError:
        polars = None
    if polars is not None:
        frame = polars.read_parquet(path)
        assert [str(t) for t in frame.dtypes] == ["Int64", "Float64"]
        assert frame["shard_id"].to_list() == list(shards) and bits(array("d", frame["total"].to_list())) == bits(
            totals)
        readers += 1
    if not readers:
        pytest.skip("neither duckdb nor polars is installed (they come from requirements-bench.txt)")


@pytest.mark.parametrize("shards, totals", [
    (["x", "y"], [1.0, 2.0]),  # string ids
    (array("q", [1]), [[1.0, 2.0]]),  # a vector total
    ([1, 2], [1.0, 2.0]),  # lists (the reference's results)
    (array("i", [1]), array("d", [1.0])),  # not int64 ids
    (array("q", [1]), array("f", [1.0])),  # float32 totals
    (array("q", [1, 2]), array("d", [1.0])),  # lengths differ
])
def test_what_it_does_not_take_is_handed_back(tmp_path: Path, shards: Any, totals: Any) -> None:
    """False, and no file: the command line then writes with pyarrow."""
    path = tmp_path / "out.parquet"
    assert parquet_native_write.write_owner_sum(str(path), shards, totals) is False and not path.exists()
    with pytest.raises(ValueError, match="takes array"):
        parquet_native_write.encode_owner_sum(shards, totals)


def test_numpy_results_and_big_endian_machines_are_handed_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy arrays (the numpy engine's results) are not its job; nor are a big-endian machine's arrays."""
    np = pytest.importorskip("numpy")
    assert not parquet_native_write.takes(np.arange(3), np.zeros(3))
    assert parquet_native_write.takes(array("q", [1]), array("d", [1.0]))
    monkeypatch.setattr(sys, "byteorder", "big")
    assert not parquet_native_write.takes(array("q", [1]), array("d", [1.0]))


# --- the command line --------------------------------------------------------------------------------------


def owner_rows_file(tmp_path: Path, seed: int, n: int, integer: bool, name: str = "rows.parquet") -> Path:
    """A Parquet file the native reader takes: int64 shards, int32 workers and owners, float64 or int64 gradients."""
    import random

    rng = random.Random(seed)
    owners = [rng.randrange(4) for _ in range(n)]
    workers = [o if rng.random() < 0.5 else rng.randrange(4) for o in owners]
    grads: list[Any] = ([rng.randrange(-(2**40), 2**40) for _ in range(n)] if integer
                        else [rng.choice(SPECIAL) if rng.random() < 0.1 else rng.gauss(0, 1) for _ in range(n)])
    table = pa.table({"shard_id": pa.array([rng.randrange(-50, 50) for _ in range(n)], pa.int64()),
                      "worker_id": pa.array(workers, pa.int32()), "owner_id": pa.array(owners, pa.int32()),
                      "gradient": pa.array(grads, pa.int64() if integer else pa.float64())})
    path = tmp_path / name
    pq.write_table(table, path)
    return path


@needs_native
@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("n", [0, 1, 500])
def test_the_command_writes_natively_what_gradagg_native_0_writes(tmp_path: Path, cli: Any,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  integer: bool, n: int) -> None:
    """`owner-sum rows.parquet -o OUT.parquet`: written by gradagg, read back equal (schema, bits) to the
    file the pyarrow path writes with GRADAGG_NATIVE=0; an empty input gives an empty file of the same schema."""
    rows = owner_rows_file(tmp_path, n, n, integer)
    native, pyarrow = tmp_path / "native.parquet", tmp_path / "pyarrow.parquet"
    assert cli("owner-sum", str(rows), "-o", str(native)).ok() == ""
    monkeypatch.setenv("GRADAGG_NATIVE", "0")
    assert cli("owner-sum", str(rows), "-o", str(pyarrow)).ok() == ""
    assert pq.ParquetFile(native).metadata.created_by.startswith("gradagg version ")
    assert pq.ParquetFile(pyarrow).metadata.created_by.startswith("parquet-cpp")
    got, want = pyarrow_columns(native), pyarrow_columns(pyarrow)
    if n == 0 and integer:
        # The one known difference, not the writer's: pyarrow's reader yields no batch for a file without rows,
        # so that path never sees the int64 gradients and writes float64 totals; the native reader yields one
        # empty batch of the file's types, and the totals stay int64.
        want = (*want[:2], want[2].set(1, pa.field("total", pa.int64())))
    assert got[:2] == want[:2] and got[2].equals(want[2], check_metadata=True)


@needs_native
def test_the_native_path_writes_parquet_without_pyarrow_or_numpy(tmp_path: Path) -> None:
    """In a fresh process, `-o OUT.parquet` after a natively read input imports neither pyarrow nor NumPy,
    and OUT holds the JSON answer's shards and totals."""
    rows, out = owner_rows_file(tmp_path, 3, 2000, False), tmp_path / "out.parquet"
    code = ("import sys; from gradagg.cli import main; "
            "status = main(['owner-sum', sys.argv[1], '-q', '-o', sys.argv[2]]);"
            " print(sorted(m for m in ('pyarrow', 'numpy', 'pandas') if m in sys.modules), file=sys.stderr);"
            " sys.exit(status)")
    proc = subprocess.run([sys.executable, "-c", code, str(rows), str(out)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stderr.strip() == "[]", proc.stderr
    answer = subprocess.run([sys.executable, "-m", "gradagg", "owner-sum", str(rows), "-q"], capture_output=True,
                            text=True, timeout=60, check=True).stdout
    table = pq.read_table(out)
    pairs = zip(table.column("shard_id").to_pylist(), table.column("total").to_pylist())
    assert [[s, "nan" if t != t else t] for s, t in pairs] == [[s, "nan" if t != t else t] for s, t in
                                                                json.loads(answer)]


@needs_native
def test_a_failure_keeps_the_old_output(tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An input error on the native path (a counted NaN with --nonfinite raise), and a disk that fills while the
    file is written (fsync fails): exit 2, one line, the old OUT as it was, no temporary file."""
    rows = owner_rows_file(tmp_path, 4, 300, False)
    out = tmp_path / "out.parquet"
    out.write_bytes(b"previous result")
    before = sorted(os.listdir(tmp_path))
    cli("owner-sum", str(rows), "--nonfinite", "raise", "-o", str(out)).error("NaN")

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    cli("owner-sum", str(rows), "-o", str(out)).error("No space left on device")
    assert sorted(os.listdir(tmp_path)) == before and out.read_bytes() == b"previous result"
