"""Smoke run of bench/bench_grpo.py (not a timed test): the figures are bench/RESULTS.md's, from a full run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]
MEMORY_ROWS = ["GRPOTrainer, TRL's own", "GRPOTrainer, exact(trainer)", "raw loop, no accumulator",
               "raw loop, accumulator, 1 term", "raw loop, accumulator, 2 terms (divisors())",
               "raw loop, accumulator, 2 terms + 1 gradient-sized buffer (stand-in)"]


def test_bench_grpo_quick_runs() -> None:
    """--quick: both GRPOTrainers train in lockstep and the table names the ratios against the 1.03 target; every
    memory form ran in its own process and printed its peak and own RSS, each baseline's ratio 1.00."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "bench/bench_grpo.py", "--quick"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=420)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert re.search(r"^\| GRPOTrainer step, TRL's own \| [\d.]+ ms \| [\d.]+ ms \| 1 \(baseline\) \|", out, re.M), out
    ratios = r"( \d+\.\d{3} \|){3} <= 1.03 \|$"
    assert re.search(r"^\| GRPOTrainer step, exact\(trainer\) \| [\d.]+ ms \| [\d.]+ ms \|" + ratios, out, re.M), out
    numbers = r" \| \d+ \| \d+\.\d\d \| -?\d+ \| -?\d+\.\d\d \|$"
    for row in MEMORY_ROWS:
        assert re.search(rf"^\| {re.escape(row)}" + numbers, out, re.M), (row, out)
    for base in MEMORY_ROWS[0], MEMORY_ROWS[2]:
        assert re.search(rf"^\| {re.escape(base)} \| \d+ \| 1\.00 \| -?\d+ \| 1\.00 \|$", out, re.M), (base, out)
    assert re.search(r"the same tokens after \d+ of \d+ steps", out), out
    assert re.search(r"load average \(1, 5, 15 min\) before the run: [\d.]+ [\d.]+ [\d.]+", out), out
