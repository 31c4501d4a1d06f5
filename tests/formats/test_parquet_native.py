"""gradagg.formats.parquet_native: the C page decoder against pyarrow, its fallbacks, and hostile files.

Generated files (random sizes, row groups, page sizes, dictionary on or off and overflowing into plain
pages, no compression or snappy, data pages v1 and v2, statistics on or off, REQUIRED or OPTIONAL
columns of int32, int64, float32, float64) are either decoded to exactly pyarrow's values, bit for bit,
or handed back (None: pyarrow reads them) for precisely the files the footer check refuses. Files with
corrupted pages or lying footers end in a FormatError/GradaggError or in pyarrow's values, never in
another exception or a crash. Batches are made small so that pages straddle batches.
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.formats.parquet_files import chunks, patch_footer, read_footer

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gradagg.errors import FormatError, GradaggError, IdError  # noqa: E402  (after the importorskips)
from gradagg.formats import _parquet_meta, parquet_native  # noqa: E402

if parquet_native.load("_pqdecode") is None:
    pytest.skip("the native decoder is not built (or GRADAGG_NATIVE=0)", allow_module_level=True)

FUZZ = settings(derandomize=True, deadline=None, max_examples=60,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
COLUMNS = parquet_native.OWNER_COLUMNS
SPECIAL = [0.0, -0.0, 1.5, -2.25, 5e-324, 1e308, float("inf"), float("-inf"), float("nan")]


@pytest.fixture(autouse=True)
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 300 rows: row groups span several, and pages straddle them."""
    monkeypatch.setattr(parquet_native, "BATCH_ROWS", 300)


def table(seed: int, n: int, id_types: tuple[Any, Any], gradient_type: Any, nullable: bool, shards: int) -> Any:
    rng = np.random.default_rng(seed)
    shard = rng.integers(-shards, shards, n).astype(id_types[0].to_pandas_dtype())
    owner = rng.integers(0, 4, n)
    worker = np.where(rng.random(n) < 0.5, owner, rng.integers(0, 4, n))
    if pa.types.is_floating(gradient_type):
        grads = rng.standard_normal(n)
        special = rng.random(n) < 0.1
        grads[special] = rng.choice(SPECIAL, int(special.sum()))
    else:
        info = np.iinfo(gradient_type.to_pandas_dtype())
        grads = rng.integers(info.min, info.max, n, dtype=info.dtype, endpoint=True)
    with np.errstate(over="ignore"):  # 1e308 is inf in a float32 file: a value like any other
        arrays = [shard, worker.astype(id_types[1].to_pandas_dtype()), owner.astype(id_types[1].to_pandas_dtype()),
                  grads.astype(gradient_type.to_pandas_dtype())]
    types = [id_types[0], id_types[1], id_types[1], gradient_type]
    schema = pa.schema([pa.field(name, t, nullable=nullable) for name, t in zip(COLUMNS, types)])
    return pa.Table.from_arrays([pa.array(a, type=t) for a, t in zip(arrays, types)], schema=schema)


@st.composite
def files(draw: Any) -> tuple[Any, dict[str, Any]]:
    ids = draw(st.sampled_from([(pa.int64(), pa.int32()), (pa.int32(), pa.int64()), (pa.int64(), pa.int64())]))
    gradient = draw(st.sampled_from([pa.float64(), pa.float32(), pa.int64(), pa.int32()]))
    n = draw(st.sampled_from([0, 1, 7, 300, 1000, 2500]))
    t = table(draw(st.integers(0, 10**6)), n, ids, gradient, draw(st.booleans()), draw(st.sampled_from([3, 500])))
    options = {
        "row_group_size": draw(st.sampled_from([None, 1, 333, 1024])),
        "data_page_size": draw(st.sampled_from([None, 64, 4096])),
        "use_dictionary": draw(st.booleans()),
        "dictionary_pagesize_limit": draw(st.sampled_from([None, 256])),  # overflows into plain pages
        "compression": draw(st.sampled_from(["none", "snappy"])),
        "data_page_version": draw(st.sampled_from(["1.0", "2.0"])),
        "write_statistics": draw(st.booleans()),
    }
    return t, {k: v for k, v in options.items() if v is not None}


def native_columns(path: Any) -> list[Any] | None:
    """Each column's values over all batches as NumPy, decoded natively; None if the reader hands the file back."""
    batches = parquet_native.owner_batches(path)
    if batches is None:
        return None
    parts: list[list[Any]] = [[], [], [], []]
    for batch in batches:
        assert len({len(c) for c in batch}) == 1
        for k, column in enumerate(batch):
            values = np.frombuffer(column.values, dtype=column.values.format) if len(column.values) else np.empty(
                0, dtype=column.values.format)
            if column.indices is not None:
                values = values[np.frombuffer(column.indices, dtype=np.uint32)]
            parts[k].append(values)
    return [np.concatenate(p) for p in parts]


def same_bits(got: Any, want: Any) -> bool:
    return got.dtype == want.dtype and got.tobytes() == want.tobytes()


@FUZZ
@given(files())
def test_values_are_pyarrows_bit_for_bit(tmp_path_factory: Any, generated: tuple[Any, dict[str, Any]]) -> None:
    """Every value as pyarrow reads it (NaN payloads and -0.0 included); None exactly when the footer is refused."""
    t, options = generated
    path = tmp_path_factory.mktemp("native") / "rows.parquet"
    pq.write_table(t, path, **options)
    got = native_columns(path)
    refused = bool(t.schema.field(0).nullable and not options["write_statistics"] and len(t))  # no null count
    assert (got is None) == refused, (options, t.schema)
    if got is not None:
        read = pq.read_table(path)
        for k, name in enumerate(COLUMNS):
            assert same_bits(got[k], read.column(name).to_numpy()), (name, options)


@pytest.mark.parametrize("case", [
    "gzip", "zstd", "strings", "uint32", "int8", "timestamp", "duration", "dictionary", "float16", "list",
    "nulls", "missing", "delta", "byte_stream_split", "huge_row_group",
])
def test_what_the_footer_check_refuses_goes_to_pyarrow(tmp_path: Path, case: str, monkeypatch: Any) -> None:
    """Codecs, types, encodings and layouts the decoder does not take: None before any row, with a reason."""
    t = table(1, 50, (pa.int64(), pa.int32()), pa.float64(), False, 5)
    options: dict[str, Any] = {"compression": "snappy"}
    swap = {"strings": ("shard_id", pa.array([str(i) for i in range(50)])),
            "uint32": ("worker_id", pa.array(np.arange(50, dtype=np.uint32))),
            "int8": ("owner_id", pa.array(np.zeros(50, dtype=np.int8))),
            "timestamp": ("gradient", pa.array(np.arange(50), pa.timestamp("s"))),
            "duration": ("gradient", pa.array(np.arange(50), pa.duration("s"))),
            "dictionary": ("shard_id", pa.array(np.arange(50)).dictionary_encode()),
            "float16": ("gradient", pa.array(np.ones(50, dtype=np.float16))),
            "list": ("gradient", pa.array([[1.0, 2.0]] * 50)),
            "nulls": ("gradient", pa.array([None] + [1.0] * 49))}
    if case in swap:
        name, column = swap[case]
        t = t.set_column(COLUMNS.index(name), name, column)
    elif case in ("gzip", "zstd"):
        options["compression"] = case
    elif case == "missing":
        t = t.drop_columns(["owner_id"])
    elif case == "delta":
        options |= {"use_dictionary": False, "column_encoding": {"shard_id": "DELTA_BINARY_PACKED"}}
    elif case == "byte_stream_split":
        options |= {"use_dictionary": False, "column_encoding": {"gradient": "BYTE_STREAM_SPLIT"}}
    elif case == "huge_row_group":
        monkeypatch.setattr(_parquet_meta, "MAX_GROUP_ROWS", 49)
    path = tmp_path / "rows.parquet"
    pq.write_table(t, path, **options)
    assert parquet_native.owner_batches(path) is None
    body, meta = read_footer(path)
    meta[-1] = len(body)
    with pytest.raises(_parquet_meta.Unsupported):
        _parquet_meta.plan_columns(meta, COLUMNS, [{1, 2}] * 3 + [{1, 2, 4, 5}])


def test_not_parquet_missing_and_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text file, a missing file, a directory, standard input as "-": pyarrow's path says what is wrong."""
    text = tmp_path / "text.parquet"
    text.write_text("not parquet at all\n")
    for path in (text, tmp_path / "missing.parquet", tmp_path, "-"):
        assert parquet_native.owner_batches(path if isinstance(path, str) else str(path)) is None
    good = tmp_path / "good.parquet"
    pq.write_table(table(2, 10, (pa.int64(), pa.int32()), pa.float64(), False, 5), good)
    assert parquet_native.owner_batches(str(good)) is not None
    monkeypatch.setenv("GRADAGG_NATIVE", "0")
    assert parquet_native.owner_batches(str(good)) is None


def test_file_objects_and_empty_files(tmp_path: Path) -> None:
    """Bytes in memory read like the file; a file without rows gives one empty batch of the columns' types."""
    t = table(3, 700, (pa.int32(), pa.int64()), pa.float32(), True, 9)
    path = tmp_path / "rows.parquet"
    pq.write_table(t, path, row_group_size=256)
    from_path = native_columns(path)
    from_bytes = native_columns(io.BytesIO(path.read_bytes()))
    assert from_path is not None and from_bytes is not None
    assert all(same_bits(a, b) for a, b in zip(from_path, from_bytes))
    pq.write_table(t.slice(0, 0), path)
    batches = list(parquet_native.owner_batches(path) or [])
    assert [[(c.values.format, len(c)) for c in b] for b in batches] == [[("i", 0), ("q", 0), ("q", 0), ("f", 0)]]


def test_progress_after_every_batch_up_to_the_total(tmp_path: Path) -> None:
    """1000 rows in row groups of 400, batches of 300: progress at 300, 400, 700, 800, 1000 rows of 1000."""
    path = tmp_path / "rows.parquet"
    pq.write_table(table(10, 1000, (pa.int64(), pa.int32()), pa.float64(), False, 5), path, row_group_size=400)
    calls: list[tuple[int, int]] = []
    for _ in parquet_native.owner_batches(path, progress=lambda done, total: calls.append((done, total))) or []:
        pass
    assert calls == [(300, 1000), (400, 1000), (700, 1000), (800, 1000), (1000, 1000)]


def test_small_dictionaries_stay_indices_big_ones_become_values(tmp_path: Path) -> None:
    """8 workers: indices into the chunk's dictionary; 5000 distinct shards in 6000 rows: plain values."""
    t = table(4, 6000, (pa.int64(), pa.int32()), pa.float64(), False, 2500)
    path = tmp_path / "rows.parquet"
    pq.write_table(t, path)
    first = next(iter(parquet_native.owner_batches(path) or []))
    shards, workers = first[0], first[1]
    assert workers.indices is not None and len(workers.values) <= 4
    assert shards.indices is None and len(shards.values) == 300  # (a dictionary of ~5000 > 300 / 8)


def corrupt(path: Path, out: Path, at: int, value: int) -> Path:
    data = bytearray(path.read_bytes())
    data[at] = value
    out.write_bytes(data)
    return out


@settings(derandomize=True, deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_corrupt_pages_are_errors_never_crashes(tmp_path_factory: Any, data: st.DataObject) -> None:
    """Any byte of the pages overwritten: pyarrow's values still (a byte that did not matter), or a clean error."""
    path = tmp_path_factory.mktemp("corrupt") / "rows.parquet"
    options = data.draw(st.sampled_from([{"compression": "snappy"}, {"compression": "none"},
                                         {"compression": "snappy", "data_page_version": "2.0"},
                                         {"use_dictionary": False, "compression": "none"}]))
    pq.write_table(table(5, 400, (pa.int64(), pa.int32()), pa.float64(), True, 20), path, data_page_size=512,
                   **options)
    body, _ = read_footer(path)
    at = data.draw(st.integers(4, len(body) - 1))
    bad = corrupt(path, path.with_name("bad.parquet"), at, data.draw(st.integers(0, 255)))
    want = [pq.read_table(path).column(c).to_numpy() for c in COLUMNS]
    try:
        got = native_columns(bad)
    except GradaggError:
        return
    assert got is not None
    # A flipped value byte changes that value and nothing else; a flip that decodes must not shift or resize.
    assert all(len(g) == len(w) and g.dtype == w.dtype for g, w in zip(got, want))


@pytest.mark.parametrize("cut", [1, 2, 10, 100])
def test_a_footer_that_cuts_a_chunk_short_is_an_error(tmp_path: Path, cut: int) -> None:
    """The footer says each chunk is shorter than its pages: FormatError naming row group and column."""
    path = tmp_path / "rows.parquet"
    pq.write_table(table(6, 500, (pa.int64(), pa.int64()), pa.float64(), False, 20), path)

    def shorten(meta: dict[int, Any]) -> None:
        for chunk in chunks(meta):
            chunk[7] = max(0, chunk[7] - cut)

    with pytest.raises(FormatError, match=r"row group 0, column 'shard_id'"):
        native_columns(patch_footer(path, tmp_path / "short.parquet", shorten))


def test_a_null_the_statistics_deny_is_an_error_naming_its_row(tmp_path: Path) -> None:
    """OPTIONAL worker_id with a null at row 377, its statistics patched to count none: an IdError for row 377."""
    t = table(7, 900, (pa.int64(), pa.int32()), pa.float64(), True, 20)
    workers = t.column("worker_id").to_pylist()
    workers[377] = None
    t = t.set_column(1, "worker_id", pa.array(workers, pa.int32()))
    path = tmp_path / "rows.parquet"
    pq.write_table(t, path, row_group_size=300)
    assert parquet_native.owner_batches(path) is None  # its statistics count the null: pyarrow's path

    def deny(meta: dict[int, Any]) -> None:
        for chunk in chunks(meta):
            chunk[12][3] = 0

    with pytest.raises(IdError, match=r"^row 377: worker_id is null"):
        native_columns(patch_footer(path, tmp_path / "denied.parquet", deny))


def test_files_of_other_writers(tmp_path: Path) -> None:
    """DuckDB's and Polars' own writers (where installed): decoded to pyarrow's values, or handed back."""
    t = table(8, 3000, (pa.int64(), pa.int32()), pa.float64(), True, 40)
    written = []
    duckdb = pytest.importorskip("duckdb")
    for codec in ("snappy", "uncompressed", "zstd"):
        path = tmp_path / f"duck_{codec}.parquet"
        duckdb.sql(f"COPY (SELECT * FROM t) TO '{path}' (FORMAT parquet, COMPRESSION {codec})")
        written.append(path)
    try:
        import polars
    except ImportError:
        polars = None
    if polars is not None:
        for codec in ("snappy", "uncompressed"):
            path = tmp_path / f"polars_{codec}.parquet"
            polars.from_arrow(t).write_parquet(path, compression=codec, statistics=True)
            written.append(path)
    decoded = 0
    for path in written:
        got = native_columns(path)
        if got is not None:
            decoded += 1
            read = pq.read_table(path)
            for k, name in enumerate(COLUMNS):
                assert same_bits(got[k], read.column(name).to_numpy().astype(got[k].dtype)), (path, name)
    assert decoded >= 2  # (snappy and uncompressed DuckDB files at least)


def test_the_native_path_imports_neither_pyarrow_nor_numpy(tmp_path: Path) -> None:
    """`gradagg owner-sum FILE.parquet` on a file the decoder takes: the reference's answer, no pyarrow, no NumPy."""
    path = tmp_path / "rows.parquet"
    pq.write_table(table(9, 2000, (pa.int64(), pa.int32()), pa.float64(), True, 30), path)
    code = ("import sys; from gradagg.cli import main; status = main(['owner-sum', sys.argv[1], '-q']); "
            "print(sorted(m for m in ('pyarrow', 'numpy', 'pandas', 'torch') if m in sys.modules), file=sys.stderr); "
            "sys.exit(status)")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr.strip() == "[]", proc.stderr
    read = pq.read_table(path)
    from gradagg import reference

    rows = [[r[c] for c in COLUMNS] for r in read.to_pylist()]
    want = reference.owner_sum(rows)
    import json

    def bits(pairs: list[Any]) -> list[Any]:  # a NaN is any NaN (which payload survives nan + nan is the hardware's)
        return [[s, "nan" if t != t else struct.pack("<d", t)] for s, t in pairs]

    assert bits(json.loads(proc.stdout)) == bits(want)


@settings(derandomize=True, deadline=None, max_examples=40,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(files(), st.sampled_from(["propagate", "raise"]))
def test_the_command_answers_alike_on_both_paths(tmp_path_factory: Any, cli: Any, monkeypatch: Any,
                                                 generated: tuple[Any, dict[str, Any]], nonfinite: str) -> None:
    """`gradagg owner-sum` natively and with GRADAGG_NATIVE=0: the same JSON, or the same one-line error.

    One difference is allowed, and checked against the reference: integer gradients whose |sum| bound
    reaches 2**63 are refused up front by the NumPy path, while the native table refuses only a total
    that really passes int64, so it may answer (exactly) where NumPy refuses.
    """
    t, options = generated
    path = str(tmp_path_factory.mktemp("both") / "rows.parquet")
    pq.write_table(t, path, **options)
    native = cli("owner-sum", path, "--nonfinite", nonfinite)
    monkeypatch.setenv("GRADAGG_NATIVE", "0")
    pyarrow = cli("owner-sum", path, "--nonfinite", nonfinite)
    monkeypatch.delenv("GRADAGG_NATIVE")
    if native != pyarrow:
        assert "could overflow int64" in pyarrow.error(), (native, pyarrow)
        if native.status == 0:
            from gradagg import reference

            rows = [[r[c] for c in COLUMNS] for r in pq.read_table(path).to_pylist()]
            import json

            assert json.loads(native.ok()) == reference.owner_sum(rows)
        else:
            native.error("passes int64")
