"""Benchmark the gradagg engines against pandas, Polars, DuckDB and the memory-read floor.

Generates seeded data for every case of issue 3 and prints ONE table of median
wall times, each with its ratio to that case's memory-read floor (one
``numpy.sum`` over the same input bytes). Every engine and peer runs side by
side on the same arrays in one process, taking turns (round-robin) so that
background noise on a shared machine hits all of them alike; each has one
untimed warm-up run first (numba compiles, caches fill, pages fault in).
gradagg runs with each engine named: ``numba`` (what ``auto`` picks for NumPy
arrays where numba is installed) and ``numpy`` (pure NumPy).
Only one case's data is alive at a time.

    .venv/bin/python bench/bench_engines.py            # full sizes, ~3 minutes on 2 cores
    .venv/bin/python bench/bench_engines.py --quick    # small sizes, seconds (the smoke test uses this)

Run the full benchmark under ``flock /tmp/gradagg-bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Runner = Callable[[], object]
# The numba engine's row, where numba is installed (engine="auto" picks it for NumPy arrays then).
JIT = [("numba", " (auto)")] if importlib.util.find_spec("numba") else []


@dataclass
class Case:
    """One benchmark case: its label, the input columns, and the runners to time on them."""

    name: str
    columns: list[Any]
    runners: dict[str, Runner] = field(default_factory=dict)


def owner_data(
    n: int, shards: int, seed: int, dim: int = 0, strings: bool = False, sparse: bool = False
) -> dict[str, Any]:
    """Seeded owner-sum columns: 3 workers; each shard's owner is fixed, so ~1/3 of rows are the owner's."""
    rng = np.random.default_rng(seed)
    if strings:  # `shards` distinct ids over n rows, each id used about n / shards times
        ids = rng.permutation(n) % shards
        shard = np.array([f"shard-{i:07d}" for i in range(shards)])[ids]
        owner = (ids * 7919 % 3).astype(np.int64)
    else:
        shard = rng.integers(0, shards, n)
        owner = shard * 7919 % 3
        if sparse:  # ids scattered over int64: no dense table possible
            shard = rng.integers(0, 2**62, shards)[shard]
    worker = rng.integers(0, 3, n)
    grad = rng.standard_normal((n, dim) if dim else n).astype(np.float32 if dim else np.float64)
    return {"shard_id": shard, "worker_id": worker, "owner_id": owner, "gradient": grad}


def floor_runner(columns: list[Any]) -> Runner:
    """One numpy.sum over the same bytes as the input (as int64 words: no float denormal stalls)."""
    words = []
    for col in columns:
        raw = np.ascontiguousarray(col).reshape(-1).view(np.uint8)
        words.append(raw[: len(raw) // 8 * 8].view(np.int64))
    return lambda: [w.sum() for w in words]


def gradagg_runners(d: dict[str, Any]) -> dict[str, Runner]:
    import torch

    from gradagg.rows import owner_sum_columns

    cols = [d["shard_id"], d["worker_id"], d["owner_id"], d["gradient"]]
    tcols = [c if c.dtype.kind == "U" else torch.from_numpy(c) for c in cols]
    return {
        **{f"gradagg {name}{note}": (lambda name=name: owner_sum_columns(*cols, engine=name)) for name, note in JIT},
        "gradagg numpy (pure NumPy)": lambda: owner_sum_columns(*cols, engine="numpy"),
        "gradagg torch tensors (auto)": lambda: owner_sum_columns(*tcols),
    }


def peer_runners(d: dict[str, Any]) -> dict[str, Runner]:
    import duckdb
    import pandas as pd
    import polars as pl
    import pyarrow as pa

    g = d["gradient"]
    gcols = {"gradient": g} if g.ndim == 1 else {f"g{k}": g[:, k] for k in range(g.shape[1])}
    base = {"shard_id": d["shard_id"], "worker_id": d["worker_id"], "owner_id": d["owner_id"]}
    df = pd.DataFrame({**base, **gcols})
    pdf = pl.DataFrame({**base, **gcols})
    table = pa.table({**base, **gcols})
    names = list(gcols)
    con = duckdb.connect()
    con.register("t", table)
    sums = ", ".join(f"SUM({c})" for c in names)
    sql = f"SELECT shard_id, {sums} FROM t WHERE worker_id = owner_id GROUP BY shard_id ORDER BY shard_id"

    def polars_lazy() -> object:
        q = pdf.lazy().filter(pl.col("worker_id") == pl.col("owner_id"))
        return q.group_by("shard_id").agg(pl.col(names).sum()).sort("shard_id").collect()

    return {
        "pandas groupby": lambda: df[df["worker_id"] == df["owner_id"]].groupby("shard_id", sort=True)[names].sum(),
        "Polars lazy group_by": polars_lazy,
        "DuckDB SQL": lambda: con.sql(sql).to_arrow_table(),
    }


def mean_case(label: str, m: int, p: int, seed: int) -> Case:
    """Microbatch mean: (M, P) float32 with 10% absent, against naive masked means and the peers."""
    import duckdb
    import pandas as pd
    import polars as pl
    import pyarrow as pa
    import torch

    from gradagg.rows import microbatch_mean_columns

    rng = np.random.default_rng(seed)
    values = rng.standard_normal((m, p), dtype=np.float32)
    present = rng.random((m, p), dtype=np.float32) >= 0.1
    tv, tp = torch.from_numpy(values), torch.from_numpy(present)
    arrays = {f"m{i}": pa.array(values[i], mask=~present[i]) for i in range(m)}
    table = pa.table(arrays)
    pdf = pl.from_arrow(table)
    df = pd.DataFrame({k: pd.arrays.FloatingArray(values[i], ~present[i]) for i, k in enumerate(arrays)})
    con = duckdb.connect()
    con.register("t", table)
    sql = "SELECT (" + " + ".join(f"COALESCE({k}, 0)" for k in arrays) + f") / {m} FROM t"

    runners: dict[str, Runner] = {
        **{f"gradagg {name}{note}": (lambda name=name: microbatch_mean_columns(values, present, engine=name))
           for name, note in JIT},
        "gradagg numpy (pure NumPy)": lambda: microbatch_mean_columns(values, present, engine="numpy"),
        "gradagg torch tensors (auto)": lambda: microbatch_mean_columns(tv, tp),
        "numpy where+sum (naive)": lambda: np.where(present, values, 0).sum(axis=0, dtype=np.float64) / m,
        "torch where+sum (naive)": lambda: torch.where(tp, tv, 0).sum(0, dtype=torch.float64) / m,
        "pandas sum(axis=1)": lambda: df.sum(axis=1) / m,
        "Polars lazy sum_horizontal": lambda: pdf.lazy().select(pl.sum_horizontal(pl.all()) / m).collect(),
        "DuckDB SQL": lambda: con.sql(sql).to_arrow_table(),
    }
    return Case(label, [values, present], runners)


def owner_case(label: str, d: dict[str, Any]) -> Case:
    cols = [d["shard_id"], d["worker_id"], d["owner_id"], d["gradient"]]
    return Case(label, cols, {**gradagg_runners(d), **peer_runners(d)})


def cases(quick: bool, seed: int) -> list[tuple[str, Callable[[str], Case]]]:
    """The issue's list (quick: 100x smaller) as (label, builder): data is made only for the case being run."""
    k = 100 if quick else 1
    n7, n6 = 10**7 // k, 10**6 // k
    s6 = f"{n6:.0e}".replace("+0", "")
    return [
        (f"owner-sum int ids N={n7:.0e} S=1e3", lambda s: owner_case(s, owner_data(n7, 1000, seed))),
        (f"owner-sum int ids N={n7:.0e} S={s6}", lambda s: owner_case(s, owner_data(n7, n6, seed))),
        (f"owner-sum str ids N={n6:.0e} S={s6}", lambda s: owner_case(s, owner_data(n6, n6, seed, strings=True))),
        (f"owner-sum f32 D=64 N={n6:.0e} S=1e3", lambda s: owner_case(s, owner_data(n6, 1000, seed, dim=64))),
        (f"owner-sum f32 D=64 N={n6:.0e} S={s6}", lambda s: owner_case(s, owner_data(n6, n6, seed, dim=64))),
        (f"microbatch mean M=8 P={n7:.0e} f32 10% absent", lambda s: mean_case(s, 8, n7, seed)),
        (f"(extra) sparse int64 ids N={n7:.0e} S={s6}", lambda s: owner_case(s, owner_data(n7, n6, seed, sparse=True))),
    ]


def environment() -> str:
    """The machine (CPU model, cores) and the versions of everything measured, for the results file."""
    import importlib.metadata
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    names = ("numpy", "numba", "torch", "pyarrow", "pandas", "polars", "duckdb")
    versions = []
    for name in names:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return f"machine: {model}, {os.cpu_count()} cores; Python {platform.python_version()}; " + ", ".join(versions)


def medians_s(runners: dict[str, Runner], repeat: int) -> dict[str, float]:
    """Median seconds per runner, the runners taking turns (round-robin) so drift hits all alike.

    On a shared 2-core machine the background (page compaction after big
    allocations, other processes, a previous runner's spinning threads) comes
    and goes; timing one runner's repeats back to back would hand all of it to
    whoever runs first.
    """
    for run in runners.values():
        run()  # warm-up: compile, fault pages in, fill caches
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeat):
        for name, run in runners.items():
            gc.collect()
            time.sleep(0.1)  # let the previous runner's worker threads (Polars, DuckDB, torch) go idle
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per cell (median reported)")
    parser.add_argument("--quick", action="store_true", help="100x smaller inputs: a smoke run in seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run only cases whose label contains this text")
    args = parser.parse_args(argv)
    print(environment())
    print(f"{'case':<40} {'engine / peer':<30} {'median ms':>10} {'x floor':>8}")
    for label, build in cases(args.quick, args.seed):
        if args.only not in label:
            continue
        case = build(label)
        floor_name = "memory-read floor (numpy.sum)"
        medians = medians_s({floor_name: floor_runner(case.columns), **case.runners}, args.repeat)
        floor = medians[floor_name]
        for name, seconds in medians.items():
            print(f"{case.name:<40} {name:<30} {seconds * 1e3:>10.1f} {seconds / floor:>8.2f}", flush=True)
        del case
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
