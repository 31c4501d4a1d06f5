"""gradagg.rows.formats.parquet in-process: schemas, streaming vs the reference, nulls, NaN, writers, memory promises.

Every streamed result is compared with :func:`gradagg.reference.owner_sum` (or
``microbatch_mean``) on the same rows: floats must be equal, not close, because
the engines add each shard's rows in row order, exactly as the reference does.
Small batches (``_BATCH_BYTES`` patched) make every file span several batches.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gradagg import reference  # noqa: E402
from gradagg.errors import FormatError, GradaggError, IdError, NonFiniteGradientError, OutputError  # noqa: E402
from gradagg.rows.engine import microbatch_mean_batches, owner_sum_batches  # noqa: E402
from gradagg.rows.formats import parquet  # noqa: E402  (after the importorskips)
from tests.rows.engine.engine_inputs import JIT  # noqa: E402

ENGINES = ["numpy", *JIT, "python", "torch"]


@pytest.fixture(autouse=True)
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """1024-row batches (the floor), so a few thousand rows span several batches."""
    monkeypatch.setattr(parquet, "_BATCH_BYTES", 1)


def owner_sum_file(path: Any, *, progress: Any = None, **kw: Any) -> tuple[Any, Any]:
    """What the command line composes: the reader's batches into the engine."""
    return owner_sum_batches(parquet.owner_batches(path, progress=progress), **kw)


def mean_file(path: str, **kw: Any) -> Any:
    return microbatch_mean_batches(parquet.microbatch_batches(path), **kw)


def engine_or_skip(engine: str) -> str:
    if engine == "torch":
        pytest.importorskip("torch")
    return engine


# --- data --------------------------------------------------------------------------------


def owner_rows(seed: int, n: int, *, strings: bool = False, dim: int | None = None) -> list[list[Any]]:
    """Seeded rows: 40 shards on 4 workers, each shard owned by one; ~1/4 of the rows are the owner's."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = rng.randrange(-5, 35)
        shard: Any = f"shard-{s}-é" if strings else s
        owner, worker = s % 4, rng.randrange(4)
        ids: tuple[Any, Any] = (f"w{worker}", f"w{owner}") if strings else (worker, owner)
        grad: Any = rng.uniform(-1, 1) if dim is None else [rng.uniform(-1, 1) for _ in range(dim)]
        rows.append([shard, *ids, grad])
    return rows


def owner_table(rows: list[list[Any]], *, dim: int | None = None, float32: bool = False) -> Any:
    ftype = pa.float32() if float32 else pa.float64()
    gtype = ftype if dim is None else pa.list_(ftype, dim)
    return pa.table(
        {
            name: pa.array([r[k] for r in rows], type=t)
            for k, (name, t) in enumerate(
                zip(parquet.OWNER_COLUMNS, [_id_type(rows, 0), _id_type(rows, 1), _id_type(rows, 2), gtype])
            )
        }
    )


def _id_type(rows: list[list[Any]], k: int) -> Any:
    return pa.string() if rows and isinstance(rows[0][k], str) else pa.int64()


def write(tmp_path: Path, table: Any, name: str = "rows.parquet", row_group_size: int | None = None) -> str:
    path = tmp_path / name
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def as_rows(shards: Any, totals: Any) -> list[list[Any]]:
    return [[s, t] for s, t in zip(list(shards) if isinstance(shards, list) else shards.tolist(), totals.tolist())]


# --- owner-sum: same answers as the reference ------------------------------------------------


@pytest.mark.parametrize("parallel_groups", [0, 1000], ids=["two-groups-at-once", "one-group-at-a-time"])
@pytest.mark.parametrize("strings", [False, True], ids=["int-ids", "string-ids"])
def test_whole_row_groups_come_in_file_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             parallel_groups: int, strings: bool) -> None:
    """40 row groups read whole (the default batch size), one at a time or two at once on two threads: the
    batches arrive in file order, so the totals are the reference's row-order bits, and progress counts up."""
    monkeypatch.setattr(parquet, "_BATCH_BYTES", 8 << 20)
    monkeypatch.setattr(parquet, "_PARALLEL_GROUPS", parallel_groups)
    rows = owner_rows(5, 2000, strings=strings)
    path = write(tmp_path, owner_table(rows), row_group_size=50)
    seen: list[int] = []
    got = owner_sum_file(path, engine="numpy", progress=lambda done, total: seen.append(done))
    assert as_rows(*got) == reference.owner_sum(rows)
    assert seen == list(range(50, 2001, 50))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("strings", [False, True], ids=["int-ids", "string-ids"])
def test_owner_sum_streams_like_the_reference(tmp_path: Path, engine: str, strings: bool) -> None:
    """3000 rows in 3 batches and 2 row groups: totals bit-identical to the reference's row-order sums."""
    rows = owner_rows(1, 3000, strings=strings)
    path = write(tmp_path, owner_table(rows), row_group_size=1700)
    got = owner_sum_file(path, engine=engine_or_skip(engine))
    assert as_rows(*got) == reference.owner_sum(rows)


@pytest.mark.parametrize("float32", [False, True], ids=["float64", "float32"])
def test_owner_sum_vector_gradients(tmp_path: Path, float32: bool) -> None:
    """Fixed-size lists of D=3; float32 elements are summed in float64, as the reference sums Python floats."""
    rows = owner_rows(2, 2500, dim=3)
    if float32:  # the values the file holds, widened: what the reference must see
        rows = [[*r[:3], [float(np.float32(x)) for x in r[3]]] for r in rows]
    path = write(tmp_path, owner_table(rows, dim=3, float32=float32))
    assert as_rows(*owner_sum_file(path)) == reference.owner_sum(rows)


def test_owner_sum_dictionary_and_large_strings(tmp_path: Path) -> None:
    rows = owner_rows(3, 1500, strings=True)
    table = owner_table(rows)
    table = table.set_column(0, "shard_id", table.column(0).cast(pa.large_string()))
    table = table.set_column(1, "worker_id", table.column(1).dictionary_encode())
    assert as_rows(*owner_sum_file(write(tmp_path, table))) == reference.owner_sum(rows)


def test_owner_sum_extra_columns_ignored_and_int32_ids(tmp_path: Path) -> None:
    table = pa.table(
        {
            "note": ["a", "b"],
            "shard_id": pa.array([7, 7], pa.int32()),
            "worker_id": pa.array([1, 2], pa.int32()),
            "owner_id": pa.array([1, 1], pa.int32()),
            "gradient": [0.5, 9.0],
        }
    )
    shards, totals = owner_sum_file(write(tmp_path, table))
    assert (shards.tolist(), totals.tolist()) == ([7], [0.5])


def test_owner_sum_empty_file_and_all_replicas(tmp_path: Path) -> None:
    empty = owner_table([[1, 0, 0, 1.0]]).slice(0, 0)
    shards, totals = owner_sum_file(write(tmp_path, empty, "empty.parquet"))
    assert shards.tolist() == [] and totals.tolist() == []
    replicas = owner_table([[1, 0, 1, 1.0], [2, 3, 0, 2.0]])
    shards, totals = owner_sum_file(write(tmp_path, replicas, "replicas.parquet"))
    assert shards.tolist() == [] and totals.tolist() == []


def test_progress_reports_every_batch_up_to_the_total(tmp_path: Path) -> None:
    path = write(tmp_path, owner_table(owner_rows(4, 2500)))
    calls: list[tuple[int, int]] = []
    owner_sum_file(path, progress=lambda done, total: calls.append((done, total)))
    assert [c[0] for c in calls] == sorted(c[0] for c in calls) and calls[-1] == (2500, 2500) and len(calls) >= 3


# --- owner-sum: errors name the row and column -------------------------------------------------


@pytest.mark.parametrize("column", ["shard_id", "worker_id", "owner_id", "gradient"])
def test_null_in_a_later_batch_names_the_file_row(tmp_path: Path, column: str) -> None:
    """Row 2100 is in the third 1024-row batch: the message counts rows from the file's start."""
    rows = owner_rows(5, 2500)
    k = parquet.OWNER_COLUMNS.index(column)
    rows[2100][k] = None
    with pytest.raises(GradaggError, match=f"row 2100: {column} is null"):
        owner_sum_file(write(tmp_path, owner_table(rows)))


def test_null_vector_element_names_row_and_element(tmp_path: Path) -> None:
    rows = owner_rows(6, 1500, dim=4)
    rows[1300][3][2] = None
    with pytest.raises(GradaggError, match="row 1300: gradient element 2 is null"):
        owner_sum_file(write(tmp_path, owner_table(rows, dim=4)))


def test_nonfinite_raise_checks_owner_rows_only(tmp_path: Path) -> None:
    """A NaN on a replica row is never counted, so never an error; on an owner row it is, with raise."""
    rows = [["a", "w1", "w0", float("nan")], ["a", "w0", "w0", 1.0]] + [["b", "w0", "w0", 1.0]] * 1100
    rows.append(["z-é", "w3", "w3", float("inf")])
    path = write(tmp_path, owner_table(rows))
    with pytest.raises(NonFiniteGradientError, match=r"row 1102: gradient of shard 'z-é' is inf"):
        owner_sum_file(path, nonfinite="raise")
    shards, totals = owner_sum_file(path)  # propagate: inf flows into z's total
    assert shards.tolist() == ["a", "b", "z-é"] and totals.tolist() == [1.0, 1100.0, float("inf")]


def test_missing_column_and_not_parquet(tmp_path: Path) -> None:
    path = write(tmp_path, pa.table({"shard_id": [1], "worker_id": [1], "gradient": [1.0]}))
    with pytest.raises(FormatError, match="missing column.s. owner_id; owner-sum needs"):
        owner_sum_file(path)
    text = tmp_path / "text.parquet"
    text.write_text("shard_id,worker_id\n")
    with pytest.raises(FormatError, match="not a readable Parquet file"):
        owner_sum_file(str(text))


# --- microbatch mean ----------------------------------------------------------------------------


def microbatch_rows(seed: int, m: int, p: int) -> list[list[Any]]:
    """M microbatches of P values, ~30% absent (None), the rest floats."""
    rng = random.Random(seed)
    return [[None if rng.random() < 0.3 else rng.uniform(-2, 2) for _ in range(p)] for _ in range(m)]


def microbatch_table(rows: list[list[Any]], float32: bool = False) -> Any:
    """The Parquet layout: column i is microbatch i, row j is parameter j."""
    t = pa.float32() if float32 else pa.float64()
    return pa.table({f"mb{i}": pa.array(row, type=t) for i, row in enumerate(rows)})


@pytest.mark.parametrize("engine", ENGINES)
def test_mean_streams_like_the_reference(tmp_path: Path, engine: str) -> None:
    """5 microbatches x 3000 parameters in 3 batches: each parameter's mean as the reference's, bit for bit."""
    rows = microbatch_rows(7, 5, 3000)
    got = mean_file(write(tmp_path, microbatch_table(rows)), engine=engine_or_skip(engine))
    assert got.tolist() == reference.microbatch_mean(rows)


def test_mean_float32_nan_propagates_and_raise_names_cell(tmp_path: Path) -> None:
    """NaN is a value: it propagates into its parameter's mean; with raise, the error names microbatch and parameter."""
    rows = [[float(np.float32(x)) if x is not None else None for x in r] for r in microbatch_rows(8, 3, 2000)]
    rows[2][1500] = float("nan")
    rows[0][1700] = None
    path = write(tmp_path, microbatch_table(rows, float32=True))
    got = mean_file(path).tolist()
    expected = reference.microbatch_mean(rows)
    assert np.isnan(got[1500]) and got[:1500] == expected[:1500] and got[1501:] == expected[1501:]
    with pytest.raises(NonFiniteGradientError, match=r"microbatch 2, parameter 1500 is nan"):
        mean_file(path, nonfinite="raise")


def test_mean_empty_and_wrong_type(tmp_path: Path) -> None:
    assert mean_file(write(tmp_path, microbatch_table([[1.0]]).slice(0, 0))).tolist() == []
    bad = pa.table({"mb0": [1.0], "mb1": ["x"]})
    with pytest.raises(FormatError, match="column 'mb1' has type string, expected a float or integer type"):
        mean_file(write(tmp_path, bad, "bad.parquet"))


# --- writers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shards", "totals", "shard_type", "total_type"),
    [
        (np.array([1, 5]), np.array([0.5, -2.0]), pa.int64(), pa.float64()),
        (["a", "é"], [1, 2**40], pa.large_string(), pa.int64()),
        ([3], [[1.5, 2.5]], pa.int64(), pa.list_(pa.float64(), 2)),
        (np.array([], dtype=np.int64), np.zeros(0), pa.int64(), pa.float64()),
    ],
)
def test_write_owner_sum_roundtrip(tmp_path: Path, shards: Any, totals: Any, shard_type: Any, total_type: Any) -> None:
    out = tmp_path / "out.parquet"
    parquet.write_owner_sum(str(out), shards, totals)
    table = pq.ParquetFile(out).read()
    assert table.schema.types == [shard_type, total_type]
    assert table.column("shard_id").to_pylist() == list(shards)
    assert table.column("total").to_pylist() == [t.tolist() if hasattr(t, "tolist") else t for t in totals]


def test_write_refuses_mixed_total_shapes_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="different shapes .scalar, vector of 2."):
        parquet.write_owner_sum(str(tmp_path / "out.parquet"), ["a", "b"], [1.0, [1.0, 2.0]])
    assert list(tmp_path.iterdir()) == []


def test_write_is_atomic_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while writing keeps the old file, leaves no temporary file, and names the output."""
    out = tmp_path / "out.parquet"
    out.write_bytes(b"old")

    def broken(table: Any, where: Any) -> None:
        where.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OutputError, match=f"^{out}: cannot write the result: disk full$"):
        parquet.write_mean(str(out), [1.0])
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]


def test_write_mean_roundtrip(tmp_path: Path) -> None:
    out = tmp_path / "mean.parquet"
    parquet.write_mean(str(out), [0.5, float("nan"), 3.0])
    table = pq.ParquetFile(out).read()
    assert table.column("parameter").to_pylist() == [0, 1, 2]
    assert table.column("mean").to_pylist()[::2] == [0.5, 3.0]


# --- promises about imports -------------------------------------------------------------------------


def test_parquet_path_imports_neither_pandas_nor_torch(tmp_path: Path) -> None:
    """pyarrow's to_numpy() and pa.array() import pandas (~0.3 s of start-up): the streaming path avoids both."""
    path = write(tmp_path, owner_table(owner_rows(9, 50, strings=True, dim=2), dim=2))
    mean = write(tmp_path, microbatch_table(microbatch_rows(9, 2, 50)), "mean.parquet")
    code = (
        "import sys; from gradagg.rows.formats import parquet as p; from gradagg.rows import engine as e; "
        f"s, t = e.owner_sum_batches(p.owner_batches({path!r})); "
        f"p.write_owner_sum({str(tmp_path / 'o.parquet')!r}, s, t); "
        f"p.write_mean({str(tmp_path / 'm.parquet')!r}, e.microbatch_mean_batches(p.microbatch_batches({mean!r}))); "
        "print(sorted(m for m in ('pandas', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ids_error_is_an_id_error(tmp_path: Path) -> None:
    rows = owner_rows(10, 10)
    rows[3][0] = None
    with pytest.raises(IdError):
        owner_sum_file(write(tmp_path, owner_table(rows)))


def test_a_binary_file_object_is_read_like_a_path(tmp_path: Path) -> None:
    """Standard input's bytes come as a file object; string ids make the reader open it twice (seek back)."""
    import io

    rows = owner_rows(11, 1500, strings=True)
    data = Path(write(tmp_path, owner_table(rows))).read_bytes()
    assert as_rows(*owner_sum_file(io.BytesIO(data))) == reference.owner_sum(rows)
    with pytest.raises(FormatError, match="<stdin>: not a readable Parquet file"):
        owner_sum_file(io.BytesIO(b"not parquet"))


def test_a_fifo_is_read_once_whole(tmp_path: Path) -> None:
    """A FIFO (or ``<(cat f.parquet)``) can be read once: it is read whole, then parsed; pyarrow reopening it
    would block in open() for ever once the writer has left (a hang deaf to signals). String ids make the
    reader open the input twice."""
    src = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"shard_id": ["b", "a", "b"], "worker_id": [0, 1, 0], "owner_id": [0, 1, 1],
                             "gradient": [1.5, 2.0, 9.0]}), src)
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    code = ("import sys; from gradagg.rows.engine import owner_sum_batches, python_values; "
            "from gradagg.rows.formats import parquet; "
            f"print([python_values(c) for c in owner_sum_batches(parquet.owner_batches({str(fifo)!r}))])")
    reader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    with open(fifo, "wb") as writer:  # blocks until the reader opens the FIFO
        writer.write(src.read_bytes())
    try:
        out, _ = reader.communicate(timeout=60)
    finally:
        reader.kill()
    assert reader.returncode == 0 and out.strip() == "[['a', 'b'], [2.0, 1.5]]", out
