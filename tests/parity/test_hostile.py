"""``gradagg parity`` against scripts that attack the checker rather than the arithmetic.

Each script below has a right step (the tiny regression of scripts/_tiny.py) and one hostile habit: a
thread that never ends started at import, a ``build_model()`` that never returns, a step that leaves
a long-lived child holding the command's output, a ``build_model()`` that changes the working
directory, a step that closes its streams, a ``full_batch_loss()`` that changes the model, a
``random.py`` beside the script. The verdict must be the step's (it is right) or name the script's
fault; the command must end, and with it everything it started. The scripts are written at test
time, not kept in tests/: the doctest collection imports every module there, and these would hang it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gradagg

torch = pytest.importorskip("torch")

from gradagg.errors import ScriptError  # noqa: E402
from gradagg.parity import check_parity  # noqa: E402
from tests.processes import gone  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]
FAST = {"timeout_s": 30.0, "collective_timeout_s": 3.0}
ROUND_OFF_64 = 1e-13  # float64 round-off of sums in another order (see test_check.py)

RIGHT = "        from _tiny import build_model, full_batch_loss, microbatches, right_step as step\n"
HOSTILE = {
    "thread_at_import": RIGHT + '''
        import threading, time
        threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon: keeps a process alive
    ''',
    "build_model_hangs": '''
        import time
        from _tiny import full_batch_loss, microbatches, right_step as step

        def build_model():
            time.sleep(3600)
    ''',
    "step_leaves_a_child": '''
        import subprocess, sys
        from _tiny import build_model, full_batch_loss, microbatches, right_step

        def step(model, microbatches):
            # inherits this rank's stdout and stderr: the command's output stays open while it lives
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            open(__file__ + ".pids", "a").write(f"{child.pid}\\n")
            right_step(model, microbatches)
    ''',
    "build_model_moves": '''
        import os
        import _tiny
        from _tiny import full_batch_loss, microbatches, right_step as step

        def build_model():
            os.chdir("/")
            return _tiny.build_model()
    ''',
    "closes_its_streams": '''
        import sys
        from _tiny import build_model, full_batch_loss, microbatches, right_step

        def step(model, microbatches):
            print("about to close my streams")
            sys.stdout.close()
            sys.stderr.close()
            right_step(model, microbatches)
    ''',
    "loss_changes_the_model": '''
        import torch
        import _tiny
        from _tiny import build_model, microbatches, right_step as step

        def full_batch_loss(model, microbatches):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(2)  # the truth would be taken at other weights than the ranks' step
            return _tiny.full_batch_loss(model, microbatches)
    ''',
}


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """The hostile scripts beside a copy of _tiny.py, and a random.py beside the right one."""
    shutil.copy(SCRIPTS / "_tiny.py", tmp_path / "_tiny.py")
    for name, source in HOSTILE.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    beside = tmp_path / "with_random"
    beside.mkdir()
    shutil.copy(SCRIPTS / "_tiny.py", beside / "_tiny.py")
    (beside / "right.py").write_text(textwrap.dedent(RIGHT))
    (beside / "random.py").write_text("raise RuntimeError('the standard library was shadowed')\n")
    return tmp_path


def _command(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``python -P -m gradagg parity ...`` (as the ``gradagg`` entry point: the working folder not on sys.path),
    its output captured: it returns once every writer has closed it."""
    package_root = str(Path(gradagg.__file__).resolve().parents[1])
    # No empty entry: one in PYTHONPATH stands for the working folder, which -P is there to keep off sys.path.
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run([sys.executable, "-P", "-m", "gradagg", "parity", *args], capture_output=True, text=True,
                          timeout=150, cwd=cwd, env=env)


def test_a_thread_started_at_import_does_not_keep_the_command_alive(hostile: Path) -> None:
    """The script never runs in the command's process: it exits with the verdict (0: the step is right)."""
    proc = _command(str(hostile / "thread_at_import.py"), "--layouts", "4", "1,3")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["passed"] is True


def test_a_build_model_that_never_returns_is_named_at_the_deadline(hostile: Path) -> None:
    with pytest.raises(ScriptError, match=r"build_model_hangs.py: loading it and computing the full batch did not "
                                          r"finish within 4 s: does its top level, build_model\(\)"):
        check_parity(str(hostile / "build_model_hangs.py"), [(4,)], timeout_s=4.0, collective_timeout_s=2.0)


def test_a_child_the_step_leaves_running_ends_with_the_command(hostile: Path) -> None:
    """The step's child holds the rank's stdout and stderr: the command still returns, and the child is gone."""
    proc = _command(str(hostile / "step_leaves_a_child.py"), "--layouts", "4", "1,3")
    assert proc.returncode == 0, proc.stderr
    pids = [int(line) for line in (hostile / "step_leaves_a_child.py.pids").read_text().split()]
    assert len(pids) == 3  # one per rank: 1 + 2
    assert all(gone(pid) for pid in pids)


def test_a_build_model_that_changes_the_working_directory_does_not_fail_a_right_step(hostile: Path) -> None:
    report = check_parity(str(hostile / "build_model_moves.py"), [(4,), (1, 3)], **FAST)
    assert report.passed, report.observations
    assert all(o["actual"] <= ROUND_OFF_64 for o in report.observations)


def test_a_step_that_closes_its_streams_is_still_judged_right(hostile: Path) -> None:
    report = check_parity(str(hostile / "closes_its_streams.py"), [(4,), (2, 2)], **FAST)
    assert report.passed, report.observations


def test_a_full_batch_loss_that_changes_the_model_is_named_not_a_divisor(hostile: Path) -> None:
    with pytest.raises(ScriptError, match=r"full_batch_loss\(\) changed the model \(parameter 'weight'\)"):
        check_parity(str(hostile / "loss_changes_the_model.py"), [(4,)], **FAST)


def test_a_random_py_beside_the_script_does_not_break_the_fork_server(hostile: Path) -> None:
    """Run from the script's folder: the fork server (``python -c``, its folder first on sys.path) starts
    elsewhere, so it imports the standard library's random, not the one there."""
    proc = _command("right.py", "--layouts", "4", "1,3", cwd=hostile / "with_random")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_command_with_its_stdout_closed_says_so_in_one_line(hostile: Path) -> None:
    proc = subprocess.run(f"exec {sys.executable} -m gradagg parity {SCRIPTS / 'right.py'} --layouts 4 >&-",
                          shell=True, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith("gradagg: error: standard output is closed") and proc.stderr.count("\n") == 1

