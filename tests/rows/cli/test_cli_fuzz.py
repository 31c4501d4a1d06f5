"""Fuzz tests of the command line over every text format, both contracts, files and standard input.

Two kinds, both seeded (hypothesis ``derandomize``: the same examples on every run, so CI is deterministic):

* generated rows with values at the edges (huge and exact integers, NaN, -0.0, surrogates, NUL, commas, quotes,
  line breaks in ids), written in a format: the command must print the reference's answer on those rows
  (as the format represents them), or exit 2 with one line exactly when the reference refuses them;
* those files mutated byte by byte (cut, inserted, replaced): the command must exit 0 with JSON on stdout, or
  exit 2 with one line, never a traceback, and a failed run leaves ``-o``'s old file and no temporary file;
* the I/O classes, in real processes: those inputs through a FIFO and under a memory limit
  (``resource.setrlimit``) answer as the file does; inputs beyond the memory allowed and full output
  devices are one line naming the file or stream.

Runs are in-process (the ``cli`` fixture) for speed; a few real processes check the same at the end.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradagg import reference
from gradagg.errors import GradaggError

Cli = Callable[..., Any]
# Example counts sized so that the whole file runs in ~20 s on 2 shared cores.
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_MUTATED = settings(FUZZ, max_examples=40)
OWNER_FIELDS = ["shard_id", "worker_id", "owner_id", "gradient"]
CANONICAL_INT = re.compile(r"0|-?[1-9][0-9]*")

# --- generated values ------------------------------------------------------------------------------------

_tricky_chars = st.sampled_from(list('ab ,"\n\r\t\x00é€😀\u2028\ufeff-07.e[]{}\\'))
_tricky_ids = st.sampled_from(["-0", "007", "+7", " 7", "7 ", "1e3", "nan", "", "0", "9" * 30, "a\u00a0"])
csv_text_ids = st.one_of(_tricky_ids, st.text(st.one_of(_tricky_chars, st.characters()), max_size=5))
json_text_ids = st.one_of(csv_text_ids, st.sampled_from(["\ud800", "a\udfff"]))  # JSON can escape lone surrogates
int_ids = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 2**63, -(2**63) - 1, 2**64]))
ints = st.one_of(st.integers(-(10**30), 10**30), st.sampled_from([10**400, -(10**400), 2**53 + 1, -(2**63)]))
scalars = st.one_of(ints, st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([-0.0, 5e-324, 1.7976931348623157e308]))
gradients = st.one_of(scalars, st.lists(scalars, min_size=1, max_size=3))
bad_values = st.sampled_from([True, None, {"a": 1}, "1", [[1]]])


@st.composite
def owner_rows(draw: st.DrawFn, ids: st.SearchStrategy[Any], bad: bool) -> list[list[Any]]:
    """Rows over a few shards and workers (so owners repeat and sums happen), sometimes with an invalid value."""
    shards = draw(st.lists(st.one_of(ids, int_ids), min_size=1, max_size=3))
    workers = draw(st.lists(st.one_of(ids, st.integers(0, 3)), min_size=1, max_size=3))
    pick = st.sampled_from
    value = st.one_of(gradients, bad_values) if bad else gradients
    return draw(st.lists(st.tuples(pick(shards), pick(workers), pick(workers), value).map(list), max_size=8))


@st.composite
def microbatches(draw: st.DrawFn, min_width: int = 0) -> list[list[Any]]:
    width = draw(st.integers(min_width, 4))
    return draw(st.lists(st.lists(st.one_of(st.none(), scalars), min_size=width, max_size=width), max_size=5))


# --- writing inputs, and what the command must answer ---------------------------------------------------


def expected_output(call: Any) -> str | None:
    """The reference's answer as the command prints it, or None when the reference refuses the rows."""
    try:
        return json.dumps(call()) + "\n"
    except GradaggError:
        return None


def owner_csv(rows: list[list[Any]]) -> tuple[str, list[list[Any]] | None]:
    """The CSV text of ``rows`` and the rows a CSV reader must see (None: the text is invalid as CSV input)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")  # quotes a cell with a comma, a quote, \r or \n
    writer.writerow(OWNER_FIELDS)
    seen: list[list[Any]] | None = []
    for row in rows:
        ids = [str(x) for x in row[:3]]
        writer.writerow([*ids, json.dumps(row[3]) if isinstance(row[3], list) else repr(row[3])])
        if seen is not None and any(s != s.strip() for s in ids):
            seen = None  # a space around an id is refused
        elif seen is not None:
            seen.append([_csv_id(s) for s in ids] + [row[3]])
    return out.getvalue(), seen


def _csv_id(cell: str) -> int | str | None:
    return None if cell == "" else int(cell) if CANONICAL_INT.fullmatch(cell) else cell


def mean_csv(rows: list[list[Any]], names: list[str] | None) -> str:
    lines = [",".join(names)] if names is not None else []
    lines += [",".join("" if v is None else repr(v) for v in row) for row in rows]
    return "".join(line + "\n" for line in lines)


def check(run: Any, expected: str | None) -> None:
    if expected is None:
        run.error()
    else:
        assert run.ok() == expected


def run_file(cli: Cli, name: str, content: bytes, contract: str, *more: str) -> Any:
    """Run on a file with -o onto an old file: the old one survives a failure, is replaced on success.

    Returns the run with ``out`` set to what -o's file holds after a success.
    """
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        path, out = tmp / name, tmp / "out.json"
        path.write_bytes(content)
        out.write_text("old\n")
        run = cli(contract, str(path), *more, "-o", str(out))
        assert run.out == "" and (run.status == 0) == (out.read_text() != "old\n"), run
        assert sorted(os.listdir(tmp)) == sorted([name, "out.json"]), "a temporary file was left behind"
        return run._replace(out=out.read_text() if run.status == 0 else "")


def run_everywhere(cli: Cli, contract: str, name: str, content: bytes, expected: str | None, *more: str) -> None:
    """The same answer from stdin with --format, from stdin recognised by content, and from a file with -o."""
    fmt = name.rsplit(".", 1)[1]
    check(cli(contract, "-", "--format", fmt, *more, stdin=content), expected)
    check(cli(contract, "-", *more, stdin=content), expected)
    check(run_file(cli, name, content, contract, *more), expected)


# --- generated rows: the reference's answer, or exit 2 exactly when it refuses ----------------------------------


@FUZZ
@given(rows=owner_rows(json_text_ids, bad=True))
def test_owner_sum_json_and_jsonl(cli: Cli, rows: list[list[Any]]) -> None:
    expected = expected_output(lambda: reference.owner_sum(rows))
    run_everywhere(cli, "owner-sum", "rows.json", json.dumps(rows).encode(), expected)
    if rows:  # an empty JSON Lines file is an error (an input with no rows is [] in JSON)
        lines = [json.dumps(dict(zip(OWNER_FIELDS, r)) if k % 2 else r) for k, r in enumerate(rows)]
        run_everywhere(cli, "owner-sum", "rows.jsonl", "\n".join(lines).encode(), expected)


@FUZZ
@given(rows=owner_rows(csv_text_ids, bad=False))
def test_owner_sum_csv(cli: Cli, rows: list[list[Any]]) -> None:
    body, seen = owner_csv(rows)
    expected = None if seen is None else expected_output(lambda: reference.owner_sum(seen))
    run_everywhere(cli, "owner-sum", "rows.csv", body.encode(), expected)


@FUZZ
@given(rows=microbatches(), bare=st.booleans(),
       counts=st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 9), st.sampled_from([-1, 1.5])))))
def test_mean_json_and_jsonl(cli: Cli, rows: list[list[Any]], counts: list[Any] | None, bare: bool) -> None:
    document = rows if bare else {"rows": rows, "active_counts": counts}
    run_everywhere(cli, "mean", "m.json", json.dumps(document).encode(),
                   expected_output(lambda: reference.microbatch_mean(rows, None if bare else counts)))
    if rows:
        body = "".join(json.dumps(r) + "\n" for r in rows).encode()
        run_everywhere(cli, "mean", "m.jsonl", body, expected_output(lambda: reference.microbatch_mean(rows)))


names = st.from_regex(r"[a-z_][a-z0-9_]{0,4}", fullmatch=True).filter(
    lambda s: s.lower() not in ("nan", "inf", "infinity"))


@FUZZ
@given(rows=microbatches(min_width=1), header=st.one_of(st.none(), st.lists(names, min_size=4, max_size=4)),
       explicit=st.booleans())
def test_mean_csv(cli: Cli, rows: list[list[Any]], header: list[str] | None, explicit: bool) -> None:
    """With a header of names or none, with --header / --no-header or without: the same microbatches."""
    width = len(rows[0]) if rows else (2 if header is None else 4)
    names_ = None if header is None else header[:width]
    body = mean_csv(rows, names_).encode()
    flag = [] if not explicit else ["--header"] if names_ is not None else ["--no-header"]
    expected = None if not body else expected_output(lambda: reference.microbatch_mean(rows))
    run_everywhere(cli, "mean", "m.csv", body, expected, *flag)


# --- mutated files: exit 0 or one line with exit 2, nothing half-written ---------------------------------

INSERTS = [b'"', b",", b"\n", b"\r", b"\r\n", b"[", b"]", b"{", b"}", b"\x00", b"\xff", b"\xef\xbb\xbf", b"1e400",
           b"NaN", b" ", b"-", b".", b"e", b"\\u", b"\\ud800", b"null", b"true", b"9" * 400, b"[" * 3000, b":",
           b'{"shard_id": 1}', b"PAR1", b"\t", b"\xed\xa0\x80", b"\xc3"]


@st.composite
def mutated(draw: st.DrawFn, content: bytes) -> bytes:
    data = bytearray(content)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["insert", "delete", "replace", "cut"]))
        if kind == "insert":
            data[at:at] = draw(st.sampled_from(INSERTS))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 4))]
        elif kind == "replace" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
    return bytes(data)


SEEDS = {
    ("owner-sum", "rows.json"): json.dumps([["x", "a", "a", 1], ["x", 1, 0, [1.5, 2]], [7, 7, 7, -0.0]]),
    ("owner-sum", "rows.jsonl"): '["x", "a", "a", 1]\n{"shard_id": "y", "worker_id": 0, "owner_id": 0, '
                                 '"gradient": 2.5}\n',
    ("owner-sum", "rows.csv"): 'shard_id,worker_id,owner_id,gradient\nx,a,a,1\n"y,1",0,0,"[1, 2]"\n7,0,0,nan\n',
    ("mean", "m.json"): '{"rows": [[2, null], [4, 6]], "active_counts": [1, 2]}',
    ("mean", "m.jsonl"): "[2, null]\n[4, 6.5]\n",
    ("mean", "m.csv"): "a,b\n2,\n,6\n4,-1e-3\n",
}


def assert_clean(run: Any) -> None:
    """Exit 0 with JSON on stdout (Python's NaN allowed), or the one-line error form; anything else fails."""
    if run.status == 0:
        json.loads(run.out)
    else:
        run.error()


@pytest.mark.parametrize(("contract", "name"), list(SEEDS), ids=[n for _, n in SEEDS])
def test_mutated_inputs_end_cleanly(cli: Cli, contract: str, name: str) -> None:
    seed = SEEDS[(contract, name)].encode()

    @FUZZ_MUTATED
    @given(mutated(seed), st.sampled_from([[], ["--nonfinite", "raise"], ["--engine", "python"]]))
    def each(content: bytes, more: list[str]) -> None:
        assert_clean(cli(contract, "-", *more, stdin=content))
        assert_clean(run_file(cli, name, content, contract, *more))

    each()


@FUZZ
@given(data=st.binary(max_size=64), contract=st.sampled_from(["owner-sum", "mean"]),
       more=st.sampled_from([[], ["--format", "csv"], ["--format", "jsonl"]]))
def test_arbitrary_bytes_on_stdin_end_cleanly(cli: Cli, data: bytes, contract: str, more: list[str]) -> None:
    assert_clean(cli(contract, "-", *more, stdin=data))


# --- a handful of real processes --------------------------------------------------------------------------

REAL = [
    ("owner-sum", b'[["x", 0, 0, ' + b"1" * 401 + b'], ["x", 0, 0, 0.5]]'),
    ("owner-sum", b"[" * 50_000),
    ("mean", b"1,abc\n2,3\n"),
    ("mean", b"\xff\xfe\x00"),
    ("owner-sum", b'shard_id,worker_id,owner_id,gradient\n"x\x00",0,0,1e400\n'),
    ("mean", b"PAR1 not really parquet"),
]


@pytest.mark.parametrize(("contract", "data"), REAL)
def test_real_processes_print_one_line(cli_process: Cli, contract: str, data: bytes) -> None:
    cli_process(contract, "-", stdin=data).error()


def test_nan_output_is_python_json(cli: Cli) -> None:
    """The mean of [NaN] prints NaN (Python's json), which is what the fuzz tests parse."""
    assert math.isnan(json.loads(cli("mean", "-", stdin=b"[[NaN]]").ok())[0])


# --- Parquet in, text out: the printed numbers read back as the reference's, bit for bit ---------------------

_edge_floats = st.sampled_from([-0.0, 0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1e16, 1e17, 2.0**53, 3.0,
                                1e-5, 1e-7, 0.1, 1.7976931348623157e308, -1.7976931348623157e308, 1e300])
_finite = st.one_of(_edge_floats, st.floats(allow_nan=False, allow_infinity=False),
                    st.integers(-(2**20), 2**20).map(float))  # integers as floats: 3.0 must stay a float
_nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])
_parquet_rows = st.booleans().flatmap(  # half the files all finite (orjson's case), half with NaN or infinity too
    lambda finite: st.lists(st.tuples(st.integers(-3, 40), st.integers(0, 2), st.integers(0, 2),
                                      _finite if finite else st.one_of(_finite, _nonfinite)), max_size=60))


def _same_bits(got: Any, want: Any) -> bool:
    """Pairs equal type for type, floats bit for bit (a NaN as a NaN: text keeps no payload)."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return (math.isnan(a) and math.isnan(b)) or a.hex() == b.hex()  # (hex keeps the sign of zero)
        return type(a) is type(b) and a == b

    return len(got) == len(want) and all(same(a, x) and same(b, y) for (a, b), (x, y) in zip(got, want))


@FUZZ
@given(rows=_parquet_rows)
def test_parquet_totals_print_as_the_reference_reads_them(cli: Cli, tmp_path_factory: pytest.TempPathFactory,
                                                         rows: list[tuple[int, int, int, float]]) -> None:
    """Whichever JSON writer prints them (orjson for finite NumPy totals where installed, json otherwise), the
    totals of a Parquet input parse back to the reference's: -0.0, subnormals, 1e16 and up, 3.0, NaN, infinity."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tmp = tmp_path_factory.mktemp("parquet")
    path = tmp / "rows.parquet"
    columns = list(zip(*rows)) if rows else [[], [], [], []]
    types = [pa.int64(), pa.int32(), pa.int32(), pa.float64()]
    pq.write_table(pa.table([pa.array(c, t) for c, t in zip(columns, types)], names=OWNER_FIELDS), path)
    want = reference.owner_sum([list(r) for r in rows])
    assert _same_bits(json.loads(cli("owner-sum", str(path)).ok()), want)
    cli("owner-sum", str(path), "-o", str(tmp / "out.jsonl")).ok()
    lines = (tmp / "out.jsonl").read_text().splitlines()
    assert _same_bits([json.loads(line) for line in lines], want)


# --- I/O classes (issue 16): non-regular inputs, memory limits, full devices; real processes -------------------

FUZZ_PROCESSES = settings(FUZZ, max_examples=3)  # each example is a few real processes: a few examples per seed


def run_real(args: list[str], *, limit_bytes: int | None = None, fifo_data: bytes | None = None,
             stdout: Any = subprocess.PIPE) -> Any:
    """``python -m gradagg ARGS`` as a process; ``fifo_data`` is written into ``args[1]`` (a FIFO) by a thread."""
    from tests.conftest import Run

    def limit() -> None:
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    proc = subprocess.Popen([sys.executable, "-m", "gradagg", *args], stdout=stdout, stderr=subprocess.PIPE,
                            preexec_fn=limit)
    if fifo_data is not None:
        def feed() -> None:
            with contextlib.suppress(BrokenPipeError), open(args[1], "wb") as f:
                f.write(fifo_data)

        threading.Thread(target=feed, daemon=True).start()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # (only if it hung: the test fails on the timeout, and nothing is left running)
    return Run(proc.returncode, (out or b"").decode(), (err or b"").decode())


@pytest.mark.parametrize(("contract", "name"), list(SEEDS), ids=[n for _, n in SEEDS])
def test_non_regular_inputs_and_memory_limits_answer_as_a_file_does(cli: Cli, contract: str, name: str) -> None:
    """Mutated inputs through a FIFO, and from a file under a 512 MiB address space: the same status and output
    as the file in this process (a FIFO is read once, into memory; a small input fits any sane limit)."""

    @FUZZ_PROCESSES
    @given(mutated(SEEDS[(contract, name)].encode()))
    def each(content: bytes) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path, fifo = Path(folder) / name, Path(folder) / f"fifo.{name}"
            path.write_bytes(content)
            os.mkfifo(fifo)
            expected = cli(contract, str(path))
            assert run_real([contract, str(fifo)], fifo_data=content)[:2] == expected[:2]
            limited = run_real([contract, str(path)], limit_bytes=512 << 20)
            assert limited[:2] == expected[:2] and (limited.status == 0 or limited.err.count("\n") == 1)

    each()


@pytest.mark.parametrize(("contract", "name"), list(SEEDS), ids=[n for _, n in SEEDS])
def test_inputs_beyond_the_memory_allowed_are_one_line(contract: str, name: str, tmp_path: Path) -> None:
    """A sparse file of 1 GiB under a 512 MiB address space, and a device that never ends: one line naming it
    (read up to the bound as CSV, up to its first NUL as JSON, where a NUL is never valid)."""
    big = tmp_path / name
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    run_real([contract, str(big)], limit_bytes=512 << 20).error(f"{big}: is 1,073,741,824 bytes")
    fmt = name.rsplit(".", 1)[1]
    expected = "/dev/zero: holds more than" if fmt == "csv" else "/dev/zero: line 1 column 1: invalid JSON"
    run_real([contract, "/dev/zero", "--format", fmt], limit_bytes=512 << 20).error(expected)


VALID = {"rows.json": '[["x", "a", "a", 1], ["y", 0, 0, 2.5]]', "m.csv": "a,b\n2,\n,6\n4,-1e-3\n"}
@pytest.mark.parametrize("ext", ["json", "jsonl", "csv", "parquet", "txt"])
@pytest.mark.parametrize(("contract", "name"), [("owner-sum", "rows.json"), ("mean", "m.csv")])
def test_full_devices_are_named(contract: str, name: str, ext: str, tmp_path: Path) -> None:
    """Every output format onto /dev/full (through a link named for it), and stdout on /dev/full: one line
    naming the output; no temporary file is left and the link stays (the device is written in place)."""
    if ext == "parquet":
        pytest.importorskip("pyarrow")
    path, link = tmp_path / name, tmp_path / f"full.{ext}"
    path.write_text(VALID[name])
    link.symlink_to("/dev/full")
    run_real([contract, str(path), "-o", str(link)]).error(f"{link}: cannot write the result: ")
    with open("/dev/full", "wb") as full:
        run = run_real([contract, str(path)], stdout=full)
    assert run.status == 2 and run.err.startswith("gradagg: error: standard output: cannot write the result: "), run
    assert sorted(os.listdir(tmp_path)) == sorted([name, link.name])
