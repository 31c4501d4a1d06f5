"""The command line with --engine, Parquet in and out, and the progress line: every format x engine vs the reference.

Most runs call :func:`gradagg.cli.main` in this process (one import of numpy,
torch and pyarrow for the whole file keeps it fast); the error format of a real
process (exactly one stderr line, exit 2, no traceback) is checked through
``python -m gradagg`` as well.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pty
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gradagg import reference  # noqa: E402  (after the importorskips)
from gradagg.rows.progress import ProgressLine  # noqa: E402
from tests.rows.engine.engine_inputs import JIT  # noqa: E402

FORMATS = ["json", "jsonl", "csv", "parquet"]
ENGINES = ["auto", "python", "numpy", *JIT, "torch"]


def assert_one_line_error(status: int, out: str, err: str, fragment: str) -> None:
    assert status == 2, (status, out, err)
    assert out == "" and err.startswith("gradagg: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err and fragment in err, err


def skip_missing(engine: str) -> None:
    if engine == "torch":
        pytest.importorskip("torch")


# --- input files in every format ----------------------------------------------------------------


def owner_rows(seed: int, n: int = 300, *, dim: int | None = None) -> list[list[Any]]:
    """String ids (never canonical integers, so CSV keeps them strings); ~1/3 of rows are the owner's."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = rng.randrange(25)
        owner, worker = f"rank{s % 3}", f"rank{rng.randrange(3)}"
        grad: Any = rng.uniform(-1, 1) if dim is None else [rng.uniform(-1, 1) for _ in range(dim)]
        rows.append([f"layer.{s}.ü", worker, owner, grad])
    return rows


def write_owner(tmp_path: Path, rows: list[list[Any]], fmt: str, dim: int | None = None) -> str:
    path = tmp_path / f"rows.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "csv":
        text = io.StringIO()
        writer = csv.writer(text)
        writer.writerow(["shard_id", "worker_id", "owner_id", "gradient"])
        writer.writerows([*r[:3], json.dumps(r[3]) if isinstance(r[3], list) else repr(r[3])] for r in rows)
        path.write_text(text.getvalue(), encoding="utf-8")
    else:
        gtype = pa.float64() if dim is None else pa.list_(pa.float64(), dim)
        columns = {
            name: pa.array([r[k] for r in rows], type=pa.string() if k < 3 else gtype)
            for k, name in enumerate(["shard_id", "worker_id", "owner_id", "gradient"])
        }
        pq.write_table(pa.table(columns), path)
    return str(path)


def mean_rows(seed: int, m: int = 4, p: int = 60) -> list[list[Any]]:
    rng = random.Random(seed)
    return [[None if rng.random() < 0.25 else rng.uniform(-3, 3) for _ in range(p)] for _ in range(m)]


def write_mean(tmp_path: Path, rows: list[list[Any]], fmt: str) -> str:
    path = tmp_path / f"mean.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps({"rows": rows, "active_counts": [1] * len(rows)}), encoding="utf-8")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "csv":
        path.write_text("".join(",".join("" if v is None else repr(v) for v in r) + "\n" for r in rows))
    else:  # Parquet: one column per microbatch, one row per parameter
        pq.write_table(pa.table({f"mb{i}": pa.array(r, type=pa.float64()) for i, r in enumerate(rows)}), path)
    return str(path)


# --- every format x engine equals the reference ---------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_owner_sum_every_format_and_engine(tmp_path: Path, cli: Any, fmt: str, engine: str) -> None:
    """Float totals equal the reference's exactly: every engine adds a shard's rows in row order."""
    skip_missing(engine)
    rows = owner_rows(1)
    status, out, err = cli("owner-sum", write_owner(tmp_path, rows, fmt), "--engine", engine)
    assert status == 0, err
    assert json.loads(out) == reference.owner_sum(rows)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_owner_sum_vector_gradients(tmp_path: Path, cli: Any, fmt: str, engine: str) -> None:
    skip_missing(engine)
    rows = owner_rows(2, dim=3)
    status, out, err = cli("owner-sum", write_owner(tmp_path, rows, fmt, dim=3), "--engine", engine)
    assert status == 0, err
    assert json.loads(out) == reference.owner_sum(rows)


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_integer_gradients_stay_exact(tmp_path: Path, cli: Any, engine: str) -> None:
    """Integer ids and gradients beyond 2^53 from JSON: the engines sum in int64, exactly."""
    skip_missing(engine)
    rows = [[2, 0, 0, 2**60], [2, 0, 0, 1], [1, 3, 1, 5], [1, 1, 1, -7]]
    path = tmp_path / "ints.json"
    path.write_text(json.dumps(rows))
    status, out, err = cli("owner-sum", str(path), "--engine", engine)
    assert status == 0, err
    assert json.loads(out) == [[1, -7], [2, 2**60 + 1]] == reference.owner_sum(rows)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_mean_every_format_and_engine(tmp_path: Path, cli: Any, fmt: str, engine: str) -> None:
    """Absent (null) counts as zero, the divisor is M = 4: equal to the reference's means."""
    skip_missing(engine)
    rows = mean_rows(3)
    status, out, err = cli("mean", write_mean(tmp_path, rows, fmt), "--engine", engine)
    assert status == 0, err
    assert json.loads(out) == reference.microbatch_mean(rows)


@pytest.mark.parametrize("contract", ["owner-sum", "mean"])
def test_empty_parquet_file(tmp_path: Path, cli: Any, contract: str) -> None:
    if contract == "owner-sum":
        path = write_owner(tmp_path, owner_rows(4, 0), "parquet")
    else:
        path = str(tmp_path / "empty.parquet")
        pq.write_table(pa.table({"mb0": pa.array([], pa.float64())}), path)
    assert cli(contract, path) == (0, "[]\n", "")


# --- Parquet output ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_owner_sum_output_parquet_roundtrip(tmp_path: Path, cli: Any, fmt: str) -> None:
    rows = owner_rows(5, dim=2)
    out = tmp_path / "out.parquet"
    assert cli("owner-sum", write_owner(tmp_path, rows, fmt, dim=2), "-o", str(out)) == (0, "", "")
    table = pq.ParquetFile(out).read()
    assert [
        [s, t] for s, t in zip(*(table.column(c).to_pylist() for c in ("shard_id", "total")))
    ] == reference.owner_sum(rows)


def test_mean_output_parquet_roundtrip(tmp_path: Path, cli: Any) -> None:
    rows = mean_rows(6)
    out = tmp_path / "out.parquet"
    assert cli("mean", write_mean(tmp_path, rows, "csv"), "-o", str(out)) == (0, "", "")
    table = pq.ParquetFile(out).read()
    assert table.column("mean").to_pylist() == reference.microbatch_mean(rows)
    assert table.column("parameter").to_pylist() == list(range(60))


# --- errors: one line, exit 2, no partial output --------------------------------------------------------


def parquet_with_null(tmp_path: Path, column: int, row: int) -> str:
    rows: list[list[Any]] = [[r[0], r[1], r[2], r[3]] for r in owner_rows(7, 50)]
    rows[row][column] = None
    return write_owner(tmp_path, rows, "parquet")


@pytest.mark.parametrize("engine", ["auto", "python", "torch"])
def test_null_id_names_row_and_column(tmp_path: Path, cli: Any, engine: str) -> None:
    skip_missing(engine)
    path = parquet_with_null(tmp_path, 2, 17)
    assert_one_line_error(*cli("owner-sum", path, "--engine", engine), "row 17: owner_id is null")


def test_nan_with_nonfinite_raise(tmp_path: Path, cli: Any) -> None:
    rows = [["a", "r0", "r0", 1.0], ["a", "r0", "r0", float("nan")]]
    path = write_owner(tmp_path, rows, "parquet")
    assert_one_line_error(
        *cli("owner-sum", path, "--nonfinite", "raise"), "row 1: gradient of shard 'a' is nan"
    )
    status, out, _ = cli("owner-sum", path)  # the default propagates: NaN is a value
    assert status == 0 and out == '[["a", NaN]]\n'


def test_wrong_schema_names_column(tmp_path: Path, cli: Any) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"shard_id": [1], "worker_id": [0], "owner_id": [0], "gradient": ["0.5"]}), path)
    assert_one_line_error(
        *cli("owner-sum", str(path)),
        "column 'gradient' has type string, expected a float or integer type",
    )
    assert_one_line_error(
        *cli("mean", str(path)), "column 'gradient' has type string, expected a float or integer type (the mean"
    )


def test_failure_leaves_no_partial_output(tmp_path: Path, cli: Any) -> None:
    """A failing input never creates -o's file nor replaces an old one, and leaves no temporary file."""
    path = parquet_with_null(tmp_path, 3, 40)
    fresh, old = tmp_path / "fresh.parquet", tmp_path / "old.parquet"
    old.write_bytes(b"previous result")
    before = sorted(p.name for p in tmp_path.iterdir())
    for out in (fresh, old):
        assert_one_line_error(*cli("owner-sum", path, "-o", str(out)), "row 40: gradient is null")
    assert sorted(p.name for p in tmp_path.iterdir()) == before and old.read_bytes() == b"previous result"


def test_real_process_errors_are_one_line(tmp_path: Path) -> None:
    """Through `python -m gradagg`: a non-Parquet .parquet file and a null id; exit 2, one line, no traceback."""
    text = tmp_path / "text.parquet"
    text.write_text("not parquet\n")
    for path, fragment in (
        (str(text), "not a readable Parquet file"),
        (parquet_with_null(tmp_path, 0, 3), "row 3: shard_id is null"),
    ):
        proc = subprocess.run([sys.executable, "-m", "gradagg", "owner-sum", path], capture_output=True, text=True)
        assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, fragment)


# --- the progress line -------------------------------------------------------------------------------------


def test_progress_line_draws_then_erases() -> None:
    stream = io.StringIO()
    with ProgressLine(stream, delay=0.0) as progress:
        progress(100, 1000)  # the first batch starts the clock
        progress(500, 1000)
        progress(1000, 1000)  # done: nothing left to show
    text = stream.getvalue()
    assert text.startswith("\rgradagg: 100 / 1,000 rows (10%), ") and text.endswith(" M rows/s\r\033[K")


def test_progress_line_waits_for_long_inputs() -> None:
    stream = io.StringIO()
    with ProgressLine(stream, delay=60.0) as progress:
        progress(1, 3)
        progress(2, 3)
    assert stream.getvalue() == ""


@pytest.mark.parametrize("quiet", [False, True])
def test_no_progress_on_a_terminal_for_short_input_or_with_quiet(tmp_path: Path, quiet: bool) -> None:
    """stderr is a terminal (a pty) here; a short input finishes before the bar's delay, --quiet never draws."""
    path = write_owner(tmp_path, owner_rows(8, 20), "parquet")
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gradagg", "owner-sum", path, *(["-q"] if quiet else [])],
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
        )
        os.set_blocking(leader, False)
        try:
            err = os.read(leader, 4096)
        except BlockingIOError:
            err = b""
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 0 and err == b"" and json.loads(proc.stdout)


def test_help_names_engines_and_auto_choice(cli: Any) -> None:
    status, out, _ = cli("owner-sum", "--help")
    flat = " ".join(out.split())
    assert status == 0 and "{auto,python,numpy,numba,torch}" in flat and "streaming numpy engine for Parquet" in flat


def test_parquet_from_standard_input(tmp_path: Path) -> None:
    """`-` with --format parquet: the file comes whole through stdin (Parquet's footer is at its end)."""
    rows = mean_rows(9)
    with open(write_mean(tmp_path, rows, "parquet"), "rb") as stdin:
        proc = subprocess.run([sys.executable, "-m", "gradagg", "mean", "-", "--format", "parquet"], stdin=stdin,
                              capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == reference.microbatch_mean(rows)


# --- holes of issue 7: each answer the reference's, or one clear line -------------------------------------------


def write_json(tmp_path: Path, name: str, value: Any) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(value), encoding="utf-8")  # ensure_ascii: NULs and lone surrogates as \\u escapes
    return str(path)


BIG_INT_ROWS = [["x", "a", "a", 1], ["y", "a", "a", 0.5], ["x", "a", "a", 2**53 + 1]]


@pytest.mark.parametrize("engine", ENGINES)
def test_exact_integer_totals_beside_floats(tmp_path: Path, cli: Any, engine: str) -> None:
    """x's gradients are all ints: its total is the exact 9007199254740994 on every engine, not 2**53 as a float."""
    skip_missing(engine)
    status, out, err = cli("owner-sum", write_json(tmp_path, "rows.json", BIG_INT_ROWS), "--engine", engine)
    assert (status, err) == (0, "") and out == '[["x", 9007199254740994], ["y", 0.5]]\n'


def test_parquet_output_never_rounds_an_exact_integer_total(tmp_path: Path, cli: Any) -> None:
    """An int total beside float ones cannot share a float64 column unrounded: refused; all-int totals stay int64."""
    out = tmp_path / "out.parquet"
    assert_one_line_error(*cli("owner-sum", write_json(tmp_path, "rows.json", BIG_INT_ROWS), "-o", str(out)),
                          "shard 'x' has the exact integer total 9007199254740994")
    assert not out.exists()
    ints = [["x", "a", "a", 2**53], ["x", "a", "a", 1], ["y", "b", "b", 3]]
    assert cli("owner-sum", write_json(tmp_path, "ints.json", ints), "-o", str(out)) == (0, "", "")
    assert pq.read_table(out).column("total").to_pylist() == [2**53 + 1, 3]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_ids_differing_by_a_trailing_nul(tmp_path: Path, cli: Any, engine: str, fmt: str) -> None:
    """'a' and 'a\\0' are two shards; worker 'w\\0' is not owner 'w', so its row is a replica and never counts."""
    skip_missing(engine)
    rows = [["a", "w", "w", 1.0], ["a\x00", "w", "w", 2.0], ["a", "w\x00", "w", 4.0]]
    path = write_owner(tmp_path, rows, "parquet") if fmt == "parquet" else write_json(tmp_path, "rows.json", rows)
    status, out, err = cli("owner-sum", path, "--engine", engine)
    assert status == 0, err
    assert json.loads(out) == reference.owner_sum(rows) == [["a", 1.0], ["a\x00", 2.0]]


@pytest.mark.parametrize("engine", ["numpy", "torch"])
@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
def test_integers_beyond_int64_on_fixed_width_engines(tmp_path: Path, cli: Any, engine: str, value: int) -> None:
    """As an id it is an exact key (the reference's answer); as a gradient the fixed-width engines cannot sum it:
    one line naming it and pointing to --engine python (which sums it), no traceback."""
    skip_missing(engine)
    as_id = write_json(tmp_path, "id.json", [[value, 0, 0, 1.5]])
    assert cli("owner-sum", as_id, "--engine", engine) == (0, f"[[{value}, 1.5]]\n", "")
    as_gradient = write_json(tmp_path, "gradient.json", [[1, 0, 0, value]])
    status, out, err = cli("owner-sum", as_gradient, "--engine", engine)
    assert_one_line_error(status, out, err, f"{value}")
    assert "beyond int64" in err and "engine='python'" in err
    assert cli("owner-sum", as_gradient, "--engine", "python") == (0, f"[[1, {value}]]\n", "")


def test_lone_surrogate_id_to_parquet_is_refused(tmp_path: Path, cli: Any) -> None:
    """JSON can carry a lone surrogate (\\ud800); UTF-8, so Parquet, cannot: one line, and no file left behind."""
    path = write_json(tmp_path, "rows.json", [["\ud800", "a", "a", 1.0]])
    out = tmp_path / "out.parquet"
    assert_one_line_error(*cli("owner-sum", path, "-o", str(out)), "lone surrogate")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


CHOICES_AND_NUMBA = [("auto", False), ("numpy", False), *[("numba", True) for _ in JIT]]


@pytest.mark.parametrize(("engine", "loads_numba"), CHOICES_AND_NUMBA)
def test_auto_on_a_parquet_file_is_numpy_never_numba(tmp_path: Path, engine: str, loads_numba: bool) -> None:
    """One run over one file: --engine auto resolves to numpy in the command (no numba import); --engine numba
    still loads the kernels (the answers are checked against the reference by the tests above)."""
    mean_path = write_mean(tmp_path, mean_rows(3), "parquet")
    owner_path = tmp_path / "owner.parquet"
    pq.write_table(pa.table({"shard_id": [2, 1, 2], "worker_id": [0, 0, 1], "owner_id": [0, 0, 0],
                             "gradient": [0.5, 1.0, 4.0]}), owner_path)
    code = (
        "import sys\n"
        "from gradagg.cli import main\n"
        f"for argv in (['owner-sum', {str(owner_path)!r}], ['mean', {mean_path!r}]):\n"
        f"    assert main([*argv, '--engine', {engine!r}, '-q']) == 0\n"
        "print('numba' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.splitlines()[-1] == str(loads_numba), proc.stdout


@pytest.mark.parametrize("engine", ["numpy", *JIT, "torch"])
@pytest.mark.parametrize("gradients", [[2**64 - 1, 1], [2**64 - 1]])
def test_uint64_parquet_gradients_beyond_int64(tmp_path: Path, cli: Any, engine: str, gradients: list[int]) -> None:
    """Issue 22: uint64 gradients past int64 in a Parquet file. The torch engine printed [[1, 0]] (2**64 wrapped)
    or [[7, -1]], exit 0; every fixed-width engine must refuse by name, and python sums them exactly."""
    skip_missing(engine)
    n = len(gradients)
    table = pa.table({"shard_id": pa.array([7] * n, pa.int64()), "worker_id": pa.array([0] * n, pa.int64()),
                      "owner_id": pa.array([0] * n, pa.int64()), "gradient": pa.array(gradients, pa.uint64())})
    pq.write_table(table, tmp_path / "f.parquet")
    path = str(tmp_path / "f.parquet")
    assert_one_line_error(*cli("owner-sum", path, "--engine", engine), "beyond int64")
    assert cli("owner-sum", path, "--engine", "python") == (0, f"[[7, {sum(gradients)}]]\n", "")
