"""The examples in examples/ do what the README says: the runnable script, and each data file's result."""

from __future__ import annotations

import json
import os
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


def test_the_readme_run_world_block_runs_when_pasted_into_a_file(tmp_path: Path) -> None:
    """The README's first training block, saved as a file and run with ``python``, prints what its comment says."""
    pytest.importorskip("torch")
    readme = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    block = next(b for b in blocks if "from gradagg.testing import run_world" in b)
    expected = block.rsplit("# ", 1)[1].strip()
    (tmp_path / "pasted.py").write_text(block)
    env = {**os.environ, "PYTHONPATH": str(Path(gradagg.__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "pasted.py"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
