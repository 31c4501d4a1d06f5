"""A fixed sample of one-line mutants of the counting rules, each of which a test must fail (issue 36).

The whole scoped set is mutmut's (``make mutate``, reported in bench/MUTATION.md); it takes far longer than CI
allows. These are the mutants a held-out audit found passing every test, and others that only a test written for
them kills. Each runs here: the package copied, the one line changed, the tests named beside it run in a fresh
process (local worlds included, which mutmut's run skips), and they must fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Mutant(NamedTuple):
    name: str
    path: str  # under src/gradagg
    old: str  # the line as it is (it must occur exactly once)
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail with it


SAMPLE = [
    Mutant("the causal shift removed", "integrations/_tokens.py",
           "    kept = labels if shifted else labels[..., 1:]\n", "    kept = labels\n",
           ("tests/integrations/test_tokens.py::test_label_tokens_counts_what_the_causal_shift_keeps",)),
    Mutant("token id 0 not counted", "integrations/_tokens.py",
           "    return int((kept != IGNORE).sum())\n", "    return int((kept > 0).sum())\n",
           ("tests/integrations/test_tokens.py::test_label_tokens_counts_what_the_causal_shift_keeps",)),
    Mutant("a row start not forced with position_ids", "torch/modes/segments.py",
           "            starts[:, 0] = True\n",
           "            if position_ids is None:\n                starts[:, 0] = True\n",
           ("tests/torch/test_segments.py::test_a_packed_row_starts_a_sequence_whatever_its_first_position",)),
    Mutant("a rank-local divisor of 0 taken as 1", "torch/accumulate/window.py",
           "        return total if total > 0 else None\n", "        return total if total > 0 else 1.0\n",
           ("tests/torch/accumulate/test_trust_ddp.py::test_a_rank_whose_own_weights_are_all_zero_has_no_rank_local_"
            "gradient",)),
    Mutant("a weight of 0 refused", "torch/accumulate/counting.py",
           "        if not math.isfinite(v) or v < 0:\n", "        if not math.isfinite(v) or v <= 0:\n",
           ("tests/torch/test_pipeline_counting.py::test_a_count_of_zero_counts_zero",)),
    Mutant("weights summed by a running float sum", "torch/accumulate/counting.py",
           "        return math.fsum(values)\n", "        return sum(values)\n",
           ("tests/torch/test_pipeline_counting.py::test_counts_are_summed_exactly_and_rounded_once",)),
]


def mutated_copy(mutant: Mutant, into: Path) -> Path:
    """A copy of src/gradagg under ``into``/src with the mutant's line changed; returns the src folder."""
    src = into / "src"
    shutil.copytree(ROOT / "src" / "gradagg", src / "gradagg", ignore=shutil.ignore_patterns("__pycache__"))
    target = src / "gradagg" / mutant.path
    text = target.read_text()
    assert text.count(mutant.old) == 1, (mutant.name, "the line to mutate is not there once: update SAMPLE")
    target.write_text(text.replace(mutant.old, mutant.new))
    return src


@pytest.mark.parametrize("mutant", SAMPLE, ids=[m.name for m in SAMPLE])
def test_each_sampled_mutant_fails_a_test(mutant: Mutant, tmp_path: Path) -> None:
    src = mutated_copy(mutant, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(ROOT)])}
    found = subprocess.run([sys.executable, "-c", "import gradagg; print(gradagg.__file__)"], cwd=ROOT, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found == str(src / "gradagg" / "__init__.py"), found  # the tests below import the mutated copy
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    # exit status 1: tests ran and some failed; 0 would be a surviving mutant, 2-5 a broken run (not a kill)
    assert run.returncode == 1, (mutant.name, run.returncode, run.stdout[-3000:], run.stderr[-2000:])
