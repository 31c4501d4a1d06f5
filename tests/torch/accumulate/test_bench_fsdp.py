"""A smoke run of the FSDP2 benchmark (bench/bench_fsdp.py); its GPU twin in bench/nccl_check.py is run on gloo
by tests/torch/test_examples_training.py.

Not a timed test: it checks that the script runs end to end on 4 gloo ranks with a small model and prints a
row per form it runs (the figures are bench/RESULTS.md's, from a full run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "GLOO_SOCKET_IFNAME": "lo"}
FORMS = ["FSDP2 sync off until the last", "FSDP2 reduce-scatter every microbatch", "gradagg shards (default)",
         "gradagg window", "gradagg shards, counts 1 4 0 3", "gradagg window, counts 1 4 0 3"]


def test_bench_fsdp_quick_prints_its_forms() -> None:
    """--quick --forms 5: the shards-only recipe is the baseline (ratio 1.00), always run; the uneven window row
    has no padding; the uneven shards row (4) names the padding rounds of each rank, max(1, 4, 0, 3) - count:
    3 0 4 1. Every form's step also runs in bench/nccl_check.py's memory table (test_examples_training.py)."""
    done = subprocess.run([sys.executable, "bench/bench_fsdp.py", "--quick", "--forms", "4,5"], capture_output=True,
                          text=True, cwd=ROOT, env=ENV, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| ([^|]+?) \|.*$", done.stdout, re.M)}
    assert set(rows) == {"form", FORMS[1], FORMS[4], FORMS[5]}, done.stdout
    assert "| 1.00 |" in rows["FSDP2 reduce-scatter every microbatch"]
    assert rows["gradagg shards, counts 1 4 0 3"].endswith("| 3 0 4 1 |"), rows
    assert rows["gradagg window, counts 1 4 0 3"].endswith("| - |"), rows


def test_bench_fsdp1_quick_prints_its_forms() -> None:
    """bench/bench_fsdp1.py --quick: FSDP1's own two recipes and gradagg's even and uneven rows; the uneven row names
    each rank's padding rounds, max(1, 4, 0, 3) - count: 3 0 4 1."""
    done = subprocess.run([sys.executable, "bench/bench_fsdp1.py", "--quick"], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| ([^|]+?) \|.*$", done.stdout, re.M)}
    assert set(rows) == {"form", "FSDP1 reduce-scatter every microbatch", "FSDP1 no_sync until the last",
                         "gradagg FSDP1 shards", "gradagg FSDP1 shards, counts 1 4 0 3"}, done.stdout
    assert rows["gradagg FSDP1 shards, counts 1 4 0 3"].endswith("| 3 0 4 1 |"), rows
