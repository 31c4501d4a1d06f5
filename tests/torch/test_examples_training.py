"""The training examples run as the README says: under torchrun (its world) and as plain scripts (a local one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
LOOPBACK = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # gloo on loopback only, whatever the host name resolves to


# bench/bench_fsdp.py's forms, in its order
FSDP_FORMS = ["FSDP2 sync off until the last", "FSDP2 reduce-scatter every microbatch", "gradagg shards (default)",
              "gradagg window", "gradagg shards, counts 1 4 0 3", "gradagg window, counts 1 4 0 3"]


def _errors(stdout: str) -> list[float]:
    return [float(e) for e in re.findall(r"max error(?: vs the full batch)? ([0-9.e+-]+)", stdout)]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_token_weighted_example_under_torchrun() -> None:
    """The CI command: 2 ranks from torchrun (no world started inside), D = 66 tokens, error ~1e-16 on each rank."""
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "examples/token_weighted.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=LOOPBACK, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(re.findall(r"^rank (\d):", proc.stdout, re.M)) == ["0", "1"]
    assert proc.stdout.count("D = 66 tokens") == 2
    assert all(e <= 1e-12 for e in _errors(proc.stdout)) and len(_errors(proc.stdout)) == 2


def test_fsdp2_example_as_a_script() -> None:
    """python examples/fsdp2_uneven.py starts its own 2 ranks: counts 0 and 3, DTensor gradients, error ~1e-16."""
    proc = subprocess.run(
        [sys.executable, "examples/fsdp2_uneven.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=LOOPBACK,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("counts [0, 3], D = 15; .grad is a DTensor") == 2
    assert all(e <= 1e-12 for e in _errors(proc.stdout)) and len(_errors(proc.stdout)) == 2


def test_nccl_check_script_skips_without_cuda_and_passes_on_gloo() -> None:
    """bench/nccl_check.py: a stated skip (exit 0) without CUDA; with --gloo its nine checks pass on 4 CPU ranks,
    and with --memory --quick it prints a line per form of bench/bench_fsdp.py (one run for both: the checks
    come first in it)."""
    import torch

    if not torch.cuda.is_available():
        skipped = subprocess.run([sys.executable, "bench/nccl_check.py"], capture_output=True, text=True, cwd=ROOT,
                                 env=LOOPBACK, timeout=120)
        assert skipped.returncode == 0 and "skipped: no CUDA device" in skipped.stdout, skipped.stderr[-2000:]
    done = subprocess.run([sys.executable, "bench/nccl_check.py", "--gloo", "--memory", "--quick"],
                          capture_output=True, text=True, cwd=ROOT, env=LOOPBACK, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    checks = re.findall(r"max error ([0-9.e+-]+)\s+ok$", done.stdout, re.M)
    assert len(checks) == 9 and all(float(e) <= 1e-10 for e in checks), done.stdout
    forms = re.findall(r"^  (.+?)\s+peak .* step ", done.stdout, re.M)
    assert forms == FSDP_FORMS, done.stdout


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
@pytest.mark.parametrize(("script", "ranks", "line"), [
    ("examples/fsdp2_uneven.py", 4, "counts [0, 3, 2, 0], D = 23; .grad is a DTensor"),
    ("examples/pipeline_exact.py", 4, "last step D = 34 (per replica [19, 15])"),  # 2 stages x 2, a tie across
])
def test_examples_run_on_the_world_size_torchrun_gives(script: str, ranks: int, line: str) -> None:
    """Not only 2 ranks: the examples take the launcher's world size (a rank with none included on 4). The token
    example reads the world size through the same code (gradagg.testing.run_world) as these two."""
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(ranks), script]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=LOOPBACK, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(line) == ranks, proc.stdout
    assert all(e <= 1e-12 for e in _errors(proc.stdout)) and len(_errors(proc.stdout)) == ranks
