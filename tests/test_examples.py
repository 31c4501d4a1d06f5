"""The examples in examples/ do what the docs say: the runnable scripts, and each data file's result.

The README's and the docs' own code blocks: tests/test_docs_blocks.py."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gradagg

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_two_rank_accumulation_example_divides_by_counted_m() -> None:
    """Rank 0 runs 1 microbatch (x = 0), rank 1 runs 3 (x = 10, 11, 12): M = 4, mean 33 / 4 = 8.25 on both."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "accumulate_two_ranks.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(4, [8.25, 8.25]), (4, [8.25, 8.25])]"


EXAMPLE_RESULTS = [
    ("owner-sum", "owner_rows.json", [["x", 1], ["y", 2], ["z", 3]]),  # z: the late owner's 3, not the replica's 1
    ("owner-sum", "owner_rows.jsonl", [["embed", [0.75, -0.75, 2.25]], ["head", [1.0, 1.0, 1.0]]]),
    ("owner-sum", "owner_rows.csv", [[2, 2.0], [10, 4]]),  # 1.5 + 0.5 from the owner 0; 10's owner is 1
    ("mean", "microbatches.json", [4.0, 2.0]),  # (9 + 3) / 3 and (2 + 4) / 3
    ("mean", "microbatches.jsonl", [3.0, 3.0]),
    ("mean", "microbatches.csv", [2.0, 2.0, 1.0]),  # (2 + 4) / 3, 6 / 3, 3 / 3
]


@pytest.mark.parametrize(("contract", "name", "expected"), EXAMPLE_RESULTS, ids=[e[1] for e in EXAMPLE_RESULTS])
def test_data_examples_give_their_result(cli: Callable[..., Any], contract: str, name: str, expected: list) -> None:
    assert json.loads(cli(contract, str(EXAMPLES / name)).ok()) == expected


def _on_a_terminal(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with stdout and stderr on a pseudo-terminal (line-buffered, as a user sees it): (status, text)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL, cwd=EXAMPLES.parent,
                            env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_accelerate_example_prints_one_whole_line_per_rank_message_on_a_terminal() -> None:
    """3 ranks on one terminal: each step's message of each rank is a line of its own, never run into another's."""
    pytest.importorskip("accelerate")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(Path(gradagg.__file__).resolve().parents[1])}
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "3", "examples/accelerate_exact.py"]
    status, text = _on_a_terminal(cmd, env, timeout=300)
    assert status == 0, text[-3000:]
    step = re.compile(r"rank (\d): step of (\d+) microbatches, D = \S+ tokens, max error vs the full batch (\S+)")
    lines = [line for line in text.splitlines() if "step of" in line]
    assert all(step.fullmatch(line) for line in lines), text
    assert sorted((m[1], m[2]) for m in map(step.fullmatch, lines) if m) == [
        ("0", "3"), ("0", "9"), ("1", "3"), ("1", "9"), ("2", "3"), ("2", "9")], text
    assert all(float(m[3]) < 1e-5 for m in map(step.fullmatch, lines) if m), text  # float32 vs float64 round-off


def test_torchtitan_example_says_what_it_needs_before_it_starts_where_it_cannot_run() -> None:
    """Without CUDA or triton (torchtitan's GPU stack), one line on stderr naming what is missing, exit 2."""
    torch = pytest.importorskip("torch")
    import importlib.util

    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        pytest.skip("this machine has CUDA and triton: the example would start training")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "torchtitan_exact.py")], capture_output=True, text=True,
                          timeout=120, cwd=EXAMPLES.parent)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("torchtitan_exact.py: needs "), proc.stderr
    assert "tests/integrations/test_torchtitan.py" in proc.stderr, proc.stderr


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_deepspeed_example_applies_the_token_mean_in_every_window() -> None:
    """ZeRO-2 on 2 ranks, uneven microbatches (none on one rank in a window): each window's applied gradient
    within float32 round-off of the float64 token mean, and the divisor the window's tokens. The script runs through
    a launcher under which DeepSpeed compiling its shared-memory op (minutes in a fresh environment) raises at once:
    the example must keep it from compiling itself."""
    pytest.importorskip("deepspeed")
    paths = [str(Path(gradagg.__file__).resolve().parents[1]), str(EXAMPLES.parent)]  # gradagg, and tests' package
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "tests.integrations.workers.deepspeed_example",
           "examples/deepspeed_exact.py", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    window = re.compile(r"window (\d): \[(\d), (\d)\] microbatches, (\d+) tokens, D = (\S+), max error (\S+)")
    found = [m for m in map(window.fullmatch, proc.stdout.splitlines()) if m]
    assert [(m[1], m[2], m[3], m[4]) for m in found] == [
        ("0", "3", "1", "16"), ("1", "0", "2", "10"), ("2", "1", "1", "7")], proc.stdout
    assert all(float(m[5]) == int(m[4]) and float(m[6]) < 1e-5 for m in found), proc.stdout
