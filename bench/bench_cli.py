"""End to end on the command line: ``gradagg owner-sum FILE.parquet`` against DuckDB's SQL over the same file.

Every command is a whole process, start-up included, as a user would run it: this
checkout's ``src``, from compiled bytecode as an installed package runs (:func:`child_env`).
gradagg reads the file with pyarrow (a row group ahead; two at once past 16 row groups)
and sums with NumPy; two floor rows show what any pyarrow-based command pays
before aggregating (importing pyarrow.parquet; decoding every row group). Both
sides write the full result (JSON/CSV text to stdout, sent to /dev/null, or a
JSON or Parquet file).
Peak resident memory is each command's own, from GNU ``time -f %M``: a child's
``ru_maxrss`` from ``os.wait4`` would start at this (large) script's RSS at
fork time, which Linux carries across ``exec``. The data is seeded and generated in row groups of 2^20 rows, so
generation itself stays in bounded memory; files live in ``bench/data/``
(git-ignored) and are reused while their recorded parameters match.

    flock /tmp/gradagg-bench.lock .venv/bin/python bench/bench_cli.py            # the full run (~6 min)
    .venv/bin/python bench/bench_cli.py --rows 1000000 --big-rows 0 --repeat 3  # a quick look

The table goes to stdout as Markdown; ``bench/RESULTS.md`` records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data"
ROW_GROUP = 1 << 20
WORKERS = 8  # ranks; each shard lives on its owner and two replicas, so a third of the rows are the owner's
SCHEMA = pa.schema(
    [("shard_id", pa.int64()), ("worker_id", pa.int32()), ("owner_id", pa.int32()), ("gradient", pa.float64())]
)
DUCK_SQL = (
    "SELECT shard_id, sum(gradient) AS total FROM read_parquet('{src}') "
    "WHERE worker_id = owner_id GROUP BY shard_id ORDER BY shard_id"
)


@dataclass
class Run:
    """One whole-process measurement: wall seconds and peak resident memory in MiB."""

    seconds: float
    rss_mib: float


# --- data ------------------------------------------------------------------------------------


def owner_file(rows: int, shards: int, seed: int) -> Path:
    """A seeded owner-sum Parquet file, generated one row group at a time (reused if already there).

    Args:
        rows: number of rows.
        shards: number of distinct shard ids (drawn uniformly from ``range(shards)``).
        seed: the generator's seed.

    Returns:
        The file's path under ``bench/data/``.
    """
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / f"owner_rows{rows}_shards{shards}_seed{seed}.parquet"
    stamp = json.dumps({"rows": rows, "shards": shards, "seed": seed, "row_group": ROW_GROUP, "v": 1})
    if path.exists() and _stamp(path) == stamp:
        return path
    rng = np.random.default_rng(seed)
    schema = SCHEMA.with_metadata({"gradagg-bench": stamp})
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, rows, ROW_GROUP):
            writer.write_table(_row_group(rng, min(ROW_GROUP, rows - start), shards, schema), row_group_size=ROW_GROUP)
    tmp.replace(path)
    return path


def _row_group(rng: np.random.Generator, n: int, shards: int, schema: pa.Schema) -> pa.Table:
    shard = rng.integers(0, shards, n, dtype=np.int64)
    owner = (shard % WORKERS).astype(np.int32)
    worker = ((owner + rng.integers(0, 3, n, dtype=np.int32)) % WORKERS).astype(np.int32)  # owner or a replica
    return pa.Table.from_arrays([shard, worker, owner, rng.standard_normal(n)], schema=schema)


def _stamp(path: Path) -> str | None:
    try:
        meta = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException):
        return None
    value = meta.get(b"gradagg-bench")
    return value.decode() if value else None


# --- measuring ---------------------------------------------------------------------------------


GNU_TIME = "/usr/bin/time"


def child_env() -> dict[str, str]:
    """The environment of every measured command: this checkout's ``src`` first, and compiled bytecode kept.

    An installed package runs from ``.pyc`` files (pip compiles them at install);
    with ``PYTHONDONTWRITEBYTECODE`` set, every run would compile gradagg's sources
    again, a cost no user pays. The bytecode goes to ``bench/data/pycache``
    (git-ignored), so the tree stays clean. ``PYTHONPATH`` makes the commands run
    the code of the checkout this script sits in, not whichever one is installed.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(DATA / "pycache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def measure(cmd: list[str]) -> Run:
    """Run ``cmd`` with stdout to /dev/null; its wall time and its own peak RSS.

    The peak comes from GNU time, whose own few MiB are the baseline the command
    inherits (``ru_maxrss`` of a child of this script would include this script's
    RSS at fork). Without GNU time, ``ru_maxrss`` is used and says so in the note.
    """
    with tempfile.NamedTemporaryFile("r") as peak, open(os.devnull, "wb") as devnull, tempfile.TemporaryFile() as err:
        wrapped = [GNU_TIME, "-f", "%M", "-o", peak.name, *cmd] if os.path.exists(GNU_TIME) else cmd
        start = time.perf_counter()
        proc = subprocess.Popen(wrapped, stdout=devnull, stderr=err, cwd=ROOT, env=child_env())
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start  # GNU time's own fork and exec: ~1 ms, on both sides alike
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed: {err.read().decode()[-2000:]}")
        kib = int(peak.read().split()[-1]) if wrapped is not cmd else usage.ru_maxrss  # KiB either way on Linux
    return Run(seconds, kib / 1024)


def medians(commands: dict[str, list[str]], repeat: int) -> dict[str, Run]:
    """Median time and peak RSS of each command, run interleaved after one warm-up each."""
    for cmd in commands.values():
        measure(cmd)  # warm-up: page cache, .pyc files
    runs: dict[str, list[Run]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, cmd in commands.items():  # interleaved, so drift hits every command alike
            runs[name].append(measure(cmd))
    return {
        name: Run(statistics.median(r.seconds for r in rs), statistics.median(r.rss_mib for r in rs))
        for name, rs in runs.items()
    }


def gradagg_cmd(path: Path, out: Path | None = None) -> list[str]:
    """``gradagg owner-sum FILE --quiet``, the result to stdout or to ``-o out``."""
    return [sys.executable, "-m", "gradagg", "owner-sum", str(path), "--quiet", *(["-o", str(out)] if out else [])]


def duckdb_cmd(path: Path, out: Path | None = None) -> list[str]:
    """DuckDB as a whole process too: the same SQL, the result written as CSV to stdout, or as JSON or Parquet."""
    target, fmt = ("/dev/stdout", "csv") if out is None else (str(out), out.suffix.lstrip("."))
    sql = f"COPY ({DUCK_SQL.format(src=path)}) TO '{target}' (FORMAT {fmt})"
    return [sys.executable, "-c", f"import duckdb; duckdb.sql({sql!r})"]


# --- checks and the report -------------------------------------------------------------------


def pyarrow_floor_cmds(path: Path) -> dict[str, list[str]]:
    """What any command built on pyarrow pays before aggregating: its import, and decoding the file's columns."""
    read = (f"import pyarrow.parquet as pq; pf = pq.ParquetFile({str(path)!r}, pre_buffer=False)\n"
            "for i in range(pf.num_row_groups):\n    pf.read_row_group(i, use_threads=True)")  # one at a time
    return {"import": [sys.executable, "-c", "import pyarrow.parquet"], "read": [sys.executable, "-c", read]}


def check_agreement(path: Path, tmp: Path) -> str:
    """Both tools' Parquet results for ``path``: same shards, totals equal to float rounding."""
    ours, theirs = tmp / "gradagg.parquet", tmp / "duckdb.parquet"
    measure(gradagg_cmd(path, ours))
    measure(duckdb_cmd(path, theirs))
    a = pq.ParquetFile(ours).read()
    b = pq.ParquetFile(theirs).read()
    same = a.column("shard_id").equals(b.column("shard_id"))
    diff = float(np.max(np.abs(np.asarray(a.column("total")) - np.asarray(b.column("total"))), initial=0.0))
    # DuckDB adds in its own (parallel) order, gradagg in row order: equal to a few ulps of the sums, not bit for bit.
    return f"{a.num_rows} distinct shards with an owner row, same ids: {same}, max |total difference| {diff:.2e}"


def import_report(empty: Path) -> str:
    """``python -X importtime`` of the whole Parquet path: the biggest imports and whether torch/pandas load."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gradagg", "owner-sum", str(empty)],
                          capture_output=True, text=True, cwd=ROOT, check=True, env=child_env())
    top: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[1].isdigit() and not parts[2].startswith(" ") and "." not in parts[2]:
            top[parts[2]] = top.get(parts[2], 0) + int(parts[1])
    biggest = sorted(top.items(), key=lambda kv: -kv[1])[:6]
    loaded = [m for m in ("torch", "pandas", "numba", "polars") if top.get(m, 0) > 1000]
    listed = ", ".join(f"{name} {us / 1000:.0f} ms" for name, us in biggest)
    return f"top-level imports (cumulative): {listed}; heavy modules loaded: {loaded or 'none'}"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def versions() -> str:
    import importlib.metadata as md

    names = ["numpy", "pyarrow", "orjson", "duckdb", "gradagg"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def _load(avg: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in avg)


def row(label: str, ours: Run, theirs: Run | None) -> str:
    if theirs is None:
        return f"| {label} | {ours.seconds:.2f} | {ours.rss_mib:.0f} | - | - | - |"
    return (f"| {label} | {ours.seconds:.2f} | {ours.rss_mib:.0f} | {theirs.seconds:.2f} | {theirs.rss_mib:.0f} "
            f"| {ours.seconds / theirs.seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=float, default=1e7, help="rows of the two main files (default 1e7)")
    parser.add_argument("--big-rows", type=float, default=1e8, help="rows of the big file (0 skips it; default 1e8)")
    parser.add_argument("--repeat", type=int, default=5, help="measured runs per command (default 5)")
    parser.add_argument("--keep-big", action="store_true", help="keep the big file for the next run (~1.4 GB)")
    args = parser.parse_args()
    n, big = int(args.rows), int(args.big_rows)
    load_before = os.getloadavg()

    lines = ["| case | gradagg s | gradagg peak RSS MiB | DuckDB s | DuckDB peak RSS MiB | gradagg / DuckDB |",
             "|---|---:|---:|---:|---:|---:|"]
    notes = []
    DATA.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=DATA) as tmpdir:
        tmp = Path(tmpdir)
        empty = owner_file(0, 1, 0)
        start = medians({"g": gradagg_cmd(empty), "d": duckdb_cmd(empty)}, args.repeat)
        lines.append(row("start-up: empty file, result to stdout", start["g"], start["d"]))
        outputs = (("result to stdout", None), ("-o result.json", tmp / "out.json"),
                   ("-o result.parquet", tmp / "out.parquet"))
        for shards in (1000, 1_000_000):
            path = owner_file(n, shards, seed=shards)
            for label, out in outputs:
                cmds = {"g": gradagg_cmd(path, out), "d": duckdb_cmd(path, out)}
                floor = shards == 1000 and out is None
                extra = pyarrow_floor_cmds(path) if floor else {}
                got = medians({**cmds, **extra}, args.repeat)
                lines.append(row(f"{n:.0e} rows, shard ids < {shards:.0e}, {label}", got["g"], got["d"]))
                if floor:  # side by side in the same run: the part of the command that is pyarrow's
                    lines.append(row("(floor) python -c 'import pyarrow.parquet'", got["import"], got["d"]))
                    lines.append(row(f"(floor) pyarrow reads the {n:.0e}-row file, no aggregation", got["read"],
                                     got["d"]))
            notes.append(f"{n:.0e} rows, shard ids < {shards:.0e}: {check_agreement(path, tmp)}")
        if big:
            path = owner_file(big, 1_000_000, seed=7)
            got = medians({"g": gradagg_cmd(path), "d": duckdb_cmd(path)}, max(1, args.repeat // 2))  # interleaved
            lines.append(row(f"{big:.0e} rows, shard ids < 1e+06, result to stdout", got["g"], got["d"]))
            if not args.keep_big:
                path.unlink()
        notes.append(import_report(empty))
    print("\n".join(lines))
    print()
    print("\n".join(f"- {note}" for note in notes))
    print(f"- load average (1, 5, 15 min) before: {_load(load_before)}, after: {_load(os.getloadavg())}")
    print(f"- machine: {machine()}")
    print(f"- versions: {versions()}")


if __name__ == "__main__":
    main()
