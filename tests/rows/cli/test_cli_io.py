"""The command line's inputs and outputs beyond regular files: FIFOs, devices, memory limits, full disks.

Also the messages a newcomer meets first: a directory given as FILE, an input of the other contract,
an engine whose package is missing, each output format by its extension. Every error is one line
that names the file or stream, exit 2.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Run

Cli = Callable[..., Any]
ROWS = [["x", "a", "a", 1], ["x", "b", "a", 9], ["y", "c", "c", 2.5]]
PAIRS = [["x", 1], ["y", 2.5]]


def gradagg(*args: str, limit_bytes: int | None = None, **popen: Any) -> subprocess.Popen[bytes]:
    """``python -m gradagg ARGS`` as a process; ``limit_bytes`` caps its address space (``ulimit -v``)."""

    def limit() -> None:
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "gradagg", *args], preexec_fn=limit, **popen)


def finish(proc: subprocess.Popen[bytes], timeout: float = 60) -> Run:
    out, err = proc.communicate(timeout=timeout)
    return Run(proc.returncode, (out or b"").decode(), (err or b"").decode())


# --- output formats: the extension names the format ------------------------------------------------------


@pytest.mark.parametrize("ext", ["jsonl", "ndjson", "JSONL"])
def test_output_jsonl_writes_json_lines(cli: Cli, tmp_path: Path, ext: str) -> None:
    """``-o x.jsonl`` wrote one JSON document before; it is JSON Lines, one result element a line, as it is read."""
    src = tmp_path / "rows.json"
    src.write_text(json.dumps(ROWS))
    out = tmp_path / f"out.{ext}"
    assert cli("owner-sum", str(src), "-o", str(out)).ok() == ""
    assert out.read_text() == '["x", 1]\n["y", 2.5]\n'
    assert cli("mean", "-", "-o", str(out), stdin=b"[1, null]\n[2, 4]\n").ok() == ""
    assert out.read_text() == "1.5\n2.0\n"


def test_output_json_for_any_other_name(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "result.txt"
    assert cli("owner-sum", "-", "-o", str(out), stdin=json.dumps(ROWS).encode()).ok() == ""
    assert json.loads(out.read_text()) == PAIRS


# --- the newcomer's messages ---------------------------------------------------------------------------------


def test_a_directory_is_named_as_one_whatever_its_name(cli: Cli, tmp_path: Path) -> None:
    """``gradagg owner-sum DIR`` blamed the extension (''): it says the path is a directory."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs.csv").mkdir()
    for name in ("runs", "runs.csv"):
        line = cli("owner-sum", str(tmp_path / name)).error(f"{name}: is a directory")
        assert "extension" not in line


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [("rows.json", '[["x", "a", "a"]]', "rows.json: row 0: expected 4 fields"),
     ("rows.jsonl", '["x", "a", "a", true]\n', "rows.jsonl: row 0: gradient must be a number"),
     ("rows.json", '[[1, 0, 0, 1], ["a", 0, 0, 2]]', "rows.json: shard ids 1 (row 0, int) and 'a'"),
     ("rows.csv", "shard_id,worker_id,owner_id,gradient\nx,a,,1\n", "rows.csv: row 0: owner_id is missing")],
)
def test_contract_errors_name_the_file(cli: Cli, tmp_path: Path, name: str, content: str, fragment: str) -> None:
    """The reference's row errors reached the user without the file's name (CSV's parse errors had it)."""
    (tmp_path / name).write_text(content)
    cli("owner-sum", str(tmp_path / name)).error(fragment)


def test_contract_errors_name_the_stream(cli: Cli) -> None:
    cli("owner-sum", "-", stdin=b'[["x", "a", "a"]]').error("<stdin>: row 0: expected 4 fields")


@pytest.mark.parametrize(
    ("command", "name", "content", "other"),
    [("mean", "rows.json", json.dumps(ROWS), "owner-sum"),
     ("mean", "rows.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS), "owner-sum"),
     ("mean", "rows.csv", "shard_id,worker_id,owner_id,gradient\nx,a,a,1\n", "owner-sum"),
     ("owner-sum", "m.json", '{"rows": [[1, null], [2, 3]], "active_counts": [1, 2]}', "mean"),
     ("owner-sum", "m.json", "[[1, null], [2, 3]]", "mean"),
     ("owner-sum", "m.csv", "a,b\n1,\n2,3\n", "mean")],
)
def test_an_input_of_the_other_contract_says_so(cli: Cli, tmp_path: Path, command: str, name: str, content: str,
                                                other: str) -> None:
    (tmp_path / name).write_text(content)
    cli(command, str(tmp_path / name)).error(f"{name} looks like an input of `gradagg {other}`, which reads it)")


def test_a_plain_error_gets_no_hint_of_the_other_contract(cli: Cli, tmp_path: Path) -> None:
    """A bad gradient is a bad owner-sum input, not a mean input: no hint."""
    (tmp_path / "rows.json").write_text('[["x", "a", "a", "lots"]]')
    assert "looks like" not in cli("owner-sum", str(tmp_path / "rows.json")).error("gradient must be a number")
    assert "looks like" not in cli("mean", str(tmp_path / "rows.json")).error()


def test_parquet_of_the_other_contract_says_so(cli: Cli, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    owner, mean = tmp_path / "rows.parquet", tmp_path / "m.parquet"
    pq.write_table(pa.table({"shard_id": ["x"], "worker_id": ["a"], "owner_id": ["a"], "gradient": [1.0]}), owner)
    pq.write_table(pa.table({"mb0": [1.0, None], "mb1": ["2", "3"]}), mean)
    cli("mean", str(owner)).error("rows.parquet looks like an input of `gradagg owner-sum`, which reads it)")
    assert "looks like" not in cli("owner-sum", str(mean)).error("m.parquet")  # a string column: no mean input
    pq.write_table(pa.table({"mb0": [1.0, None], "mb1": [2.0, 3.0]}), mean)
    cli("owner-sum", str(mean)).error("m.parquet looks like an input of `gradagg mean`, which reads it)")


ROWS_HINT = "install it with: pip install -e '.[rows]' in a clone of gradagg (it is not on PyPI)"


@pytest.mark.parametrize("command", ["owner-sum", "mean"])
@pytest.mark.parametrize("engine", ["auto", "python", "numpy", "torch"])
def test_a_file_command_without_the_rows_extra_is_one_line(tmp_path: Path, command: str, engine: str) -> None:
    """Without site-packages on the path, the rows extra (numpy, pyarrow) is not installed: the file commands end
    with one line naming the install from a clone (gradagg is not on PyPI), before the input is read, whatever
    the engine; `gradagg verify` (the core) still runs on the standard library alone."""
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ROWS))
    run = python_without_site_packages(command, str(rows), "--engine", engine)
    run.error(f"gradagg {command} needs numpy and pyarrow (the rows extra), which are not installed here; {ROWS_HINT}")
    assert python_without_site_packages("verify").status == 0


def test_an_engine_whose_package_is_not_installed_is_one_line(tmp_path: Path) -> None:
    """The rows extra installed, torch not: --engine torch is one line naming torch's extra, before any read."""
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ROWS))
    code = ("import sys; sys.modules['torch'] = None; from gradagg.cli import main; "
            "sys.argv = ['gradagg', *sys.argv[1:]]; sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code, "owner-sum", str(rows), "--engine", "torch"],
                          capture_output=True, text=True, timeout=60)
    Run(proc.returncode, proc.stdout, proc.stderr).error(
        "--engine torch needs torch, which is not installed here; install it with: pip install -e '.[torch]' in a "
        "clone of gradagg (it is not on PyPI) (or use --engine auto or python)")


def test_a_package_that_fails_to_import_is_one_line(tmp_path: Path) -> None:
    """Wherever an optional import fails (here numpy, blocked), the command ends with one line, exit 2."""
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ROWS))
    code = ("import sys; sys.modules['numpy'] = None; from gradagg.cli import main; "
            "sys.argv = ['gradagg', *sys.argv[1:]]; sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code, "owner-sum", str(rows), "--engine", "numpy"],
                          capture_output=True, text=True, timeout=60)
    Run(proc.returncode, proc.stdout, proc.stderr).error("gradagg owner-sum needs numpy (the rows extra), which")


@pytest.mark.parametrize(("args", "message"), [
    (["rows.parquet"], "reading Parquet needs pyarrow and numpy"),
    (["rows.json", "-o", "out.parquet"], "out.parquet: cannot write the result: writing Parquet needs pyarrow"),
])
def test_parquet_with_a_broken_pyarrow_is_one_line_naming_the_extra(tmp_path: Path, args: list[str],
                                                                    message: str) -> None:
    """pyarrow found but failing to import (a broken install passes the rows check): reading and writing Parquet
    share one importer, one line naming the rows extra."""
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    broken = tmp_path / "site" / "pyarrow"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken pyarrow')\n")
    code = (f"import sys; sys.path.insert(0, {str(broken.parent)!r}); from gradagg.cli import main; "
            "sys.argv = ['gradagg', *sys.argv[1:]]; sys.exit(main())")
    paths = [str(tmp_path / a) if a.endswith((".json", ".parquet")) else a for a in args]
    proc = subprocess.run([sys.executable, "-c", code, "owner-sum", *paths], capture_output=True, text=True,
                          timeout=60)
    line = Run(proc.returncode, proc.stdout, proc.stderr).error(message)
    assert "install them with: pip install -e '.[rows]' in a clone of gradagg" in line


def python_without_site_packages(*args: str) -> Run:
    code = ("import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]; from gradagg.cli import main; "
            "sys.argv = ['gradagg', *sys.argv[1:]]; sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    return Run(proc.returncode, proc.stdout, proc.stderr)


# --- inputs that are not regular files: read once, signals always work ---------------------------------------


def parquet_bytes(tmp_path: Path) -> bytes:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "source.parquet"
    pq.write_table(pa.table({k: [r[i] for r in ROWS] for i, k in enumerate(
        ["shard_id", "worker_id", "owner_id", "gradient"])}), path)
    return path.read_bytes()


def feed_fifo(path: Path, data: bytes) -> threading.Thread:
    """A writer that opens the FIFO, writes ``data`` and leaves (pyarrow then blocked, reopening it)."""

    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("fmt", ["parquet", "json", "csv"])
def test_a_fifo_is_read_once(tmp_path: Path, fmt: str) -> None:
    """A FIFO named rows.parquet hung for ever (pyarrow reopened it after the writer left); it is read once."""
    fifo = tmp_path / f"rows.{fmt}"
    os.mkfifo(fifo)
    data = {"parquet": lambda: parquet_bytes(tmp_path), "json": lambda: json.dumps(ROWS).encode(),
            "csv": lambda: b"shard_id,worker_id,owner_id,gradient\nx,a,a,1\nx,b,a,9\ny,c,c,2.5\n"}[fmt]()
    proc = gradagg("owner-sum", str(fifo))
    feed_fifo(fifo, data).join(timeout=60)
    assert json.loads(finish(proc).ok()) == PAIRS


def test_process_substitution_is_recognised_by_content(tmp_path: Path) -> None:
    """``<(cat x.parquet)`` is /dev/fd/63, a pipe with no extension: read once, recognised as stdin is."""
    source = tmp_path / "x.parquet"
    source.write_bytes(parquet_bytes(tmp_path))
    for extra in ("", "--format parquet"):
        proc = subprocess.run(["bash", "-c", f'"$0" -m gradagg owner-sum <(cat "$1") {extra}', sys.executable,
                               str(source)], capture_output=True, text=True, timeout=60)
        assert json.loads(Run(proc.returncode, proc.stdout, proc.stderr).ok()) == PAIRS


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("writer", ["none", "silent"])
def test_signals_stop_a_command_waiting_on_a_fifo(tmp_path: Path, signum: int, writer: str) -> None:
    """Blocked in open() (no writer yet) or in read() (a writer that writes nothing): the signal ends it at once."""
    fifo = tmp_path / "rows.parquet"
    os.mkfifo(fifo)
    proc = gradagg("owner-sum", str(fifo))
    held = open(fifo, "wb") if writer == "silent" else None  # noqa: SIM115  (held open across the signal)
    try:
        time.sleep(1.0)  # the command is started and waiting
        proc.send_signal(signum)
        run = finish(proc, timeout=20)
    finally:
        if held is not None:
            held.close()
    assert run.status == 128 + signum and run.err.count("\n") == 1 and "Traceback" not in run.err, run


def test_a_device_is_read_with_a_bound(tmp_path: Path) -> None:
    """/dev/zero never ends: as CSV (where a NUL may be in a cell) what is read stops at half the memory
    allowed, with a line that says so; as JSON (where a NUL never is) at its first byte, the reader's error."""
    run = finish(gradagg("owner-sum", "/dev/zero", "--format", "csv", limit_bytes=512 << 20), timeout=120)
    assert "half the memory allowed" in run.error("/dev/zero: holds more than")
    for fmt in ("json", "jsonl"):
        finish(gradagg("mean", "/dev/zero", "--format", fmt)).error("/dev/zero: line 1 column 1: invalid JSON")


# --- memory limits: one line naming the file, exit 2 ----------------------------------------------------------


def test_a_file_larger_than_memory_is_refused_before_reading(tmp_path: Path) -> None:
    """A sparse file of 4 GiB under a 1 GiB address space: refused from its size, naming it (it was a MemoryError)."""
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(4 << 30)
    run = finish(gradagg("owner-sum", str(big), limit_bytes=1 << 30), timeout=60)
    line = run.error("big.json: is 4,294,967,296 bytes")
    assert "at most half the memory allowed" in line


@pytest.mark.parametrize("command", ["owner-sum", "mean"])
def test_running_out_of_memory_while_parsing_is_one_line(tmp_path: Path, command: str) -> None:
    """A 48 MB JSON of floats fits the bound (a 512 MiB address space) but not as Python floats (~8x): the
    MemoryError (a traceback, exit 1, before) is one line naming the file."""
    path = tmp_path / "floats.json"
    values = ",".join(["0.5"] * 12_000_000)
    path.write_text(f'[["x", 0, 0, [{values}]]]' if command == "owner-sum" else f"[[{values}]]")
    finish(gradagg(command, str(path), limit_bytes=512 << 20), timeout=120).error("floats.json: out of memory")


# --- full devices: the message names the output ---------------------------------------------------------------


@pytest.mark.parametrize("ext", ["json", "csv", "jsonl"])
def test_a_full_output_device_is_named(tmp_path: Path, ext: str) -> None:
    """``-o /dev/full`` (through a link named for each format) said only "No space left on device"."""
    link = tmp_path / f"full.{ext}"
    link.symlink_to("/dev/full")
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ROWS))
    finish(gradagg("owner-sum", str(rows), "-o", str(link))).error(f"{link}: cannot write the result: No space left")
    finish(gradagg("owner-sum", str(rows), "-o", "/dev/full")).error("/dev/full: cannot write the result: No space")


def test_a_full_parquet_output_is_named(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    link = tmp_path / "full.parquet"
    link.symlink_to("/dev/full")
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ROWS))
    finish(gradagg("owner-sum", str(rows), "-o", str(link))).error(f"{link}: cannot write the result:")


def test_standard_output_on_a_full_device_is_named(tmp_path: Path) -> None:
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ROWS))
    with open("/dev/full", "wb") as full:
        run = finish(gradagg("owner-sum", str(rows), stdout=full))
    assert run.status == 2 and run.err.count("\n") == 1, run
    assert run.err == "gradagg: error: standard output: cannot write the result: No space left on device\n"
