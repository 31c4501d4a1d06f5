"""gradagg.testing: a call outside the main guard is refused, a lone process has a deadline, and nothing a
rank starts outlives its world."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

import gradagg  # noqa: E402
from gradagg.testing import launch_local_world, launch_process  # noqa: E402
from tests.processes import gone
from tests.testing import workers as w  # noqa: E402

SCRIPT = '''
import torch.distributed as dist
from gradagg.testing import run_world


def rank():
    return dist.get_rank()

{call}
'''


def _run(tmp_path: Path, call: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "example.py"
    path.write_text(textwrap.dedent(SCRIPT.format(call=call)))
    env = {**os.environ, "PYTHONPATH": str(Path(gradagg.__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env)


def test_run_world_at_a_scripts_top_level_is_one_clear_error(tmp_path: Path) -> None:
    """Unguarded, each rank would import the script again and start a world of its own: refused up front."""
    proc = _run(tmp_path, "print(run_world(rank, 2))")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gradagg.errors.GradaggError: ") and "example.py line 9" in last, proc.stderr
    assert 'if __name__ == "__main__":' in last
    assert proc.stderr.count("Traceback") == 1 and "multiprocessing" not in proc.stderr


def test_run_world_under_the_main_guard_runs(tmp_path: Path) -> None:
    proc = _run(tmp_path, 'if __name__ == "__main__":\n    print(run_world(rank, 2))')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0, 1]"


def test_a_lone_process_has_no_group_and_runs_in_the_callers_folder(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert launch_process(w.has_a_process_group).value is False
    outcome = launch_process(w.cwd_and_pid)
    assert outcome.ok and outcome.value[0] == str(tmp_path) and outcome.value[1] != os.getpid()


def test_a_lone_process_past_its_deadline_is_killed() -> None:
    outcome = launch_process(w.sleeps, 600, timeout_s=1.0)
    assert not outcome.ok and "did not finish before the deadline" in (outcome.error or "")


def test_a_process_a_rank_leaves_running_ends_with_the_world() -> None:
    pids = [o.value for o in launch_local_world(w.leaves_a_child, 2, timeout_s=60.0)]
    assert len(pids) == 2 and all(gone(pid) for pid in pids)



def test_the_sessions_fork_server_preloads_what_conftest_asks() -> None:
    """tests/conftest.py asks the server for FSDP2's modules (also_preload): a rank has them before its work,
    and not a module nobody asked for."""
    names = ["torch.distributed.fsdp", "torch._dynamo", "torch.distributed.pipelining", "tabulate"]
    assert launch_process(w.preloaded, names).value == [True, True, True, False]
