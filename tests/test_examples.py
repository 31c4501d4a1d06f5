"""The runnable examples in examples/ do what the README says they do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_two_rank_accumulation_example_divides_by_counted_m() -> None:
    """Rank 0 runs 1 microbatch (x = 0), rank 1 runs 3 (x = 10, 11, 12): M = 4, mean 33 / 4 = 8.25 on both."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "accumulate_two_ranks.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(4, [8.25, 8.25]), (4, [8.25, 8.25])]"
