"""``gradagg demo`` end to end: gradagg at round-off from the full-batch gradient, every wrong approach far off.

The demo starts real gloo worlds on loopback; each run here is 2 or 3 steps (most of the time is starting
processes). The verdicts are read from the result objects (:func:`gradagg.demo.demonstrate`), not from
the printed tables; one real process checks the exit status, stderr and the plot. The wrong approaches'
formulas are checked in closed form, without processes, in test_approaches.py; the cases' ground truths
in test_cases.py.
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import gradagg.demo
from gradagg.demo import results
from gradagg.errors import GradaggError

torch = pytest.importorskip("torch")

from gradagg.demo.approaches import MOE_APPROACHES, TOKEN_APPROACHES  # noqa: E402  (needs torch)

APPROACHES = {"tokens": [a.name for a in TOKEN_APPROACHES], "moe": [a.name for a in MOE_APPROACHES]}
# A wrong approach must miss by far more than round-off: its smallest max-error in these runs is ~6e-3
# (local tokens x W at step 2). 1e-3 is 9 orders of magnitude above the tolerance and below every mistake.
CLEARLY_WRONG = 1e-3


def _args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gradagg.demo.add_arguments(parser)
    return parser.parse_args(["--plot", str(tmp_path / "out" / "demo.png"), *argv])


def _summaries(outcome: results.Outcome) -> dict[str, dict[str, tuple[float, float]]]:
    """case -> approach -> (max error over steps, final loss), from the result objects."""
    out = {}
    for case in outcome.cases:
        out[case.case] = {a.name: (case.max_error(a.name), case.final_loss[a.name]) for a in case.approaches}
        assert list(out[case.case]) == APPROACHES[case.case], out
    return out


def _assert_exact_and_wrong(summaries: dict[str, dict[str, tuple[float, float]]]) -> None:
    for case, rows in summaries.items():
        assert rows[results.GRADAGG][0] <= results.TOLERANCE, (case, rows)
        for name in APPROACHES[case][1:]:
            assert rows[name][0] > CLEARLY_WRONG, (case, name, rows[name])


def _demonstrate(**config: object) -> results.Outcome:
    from gradagg.demo.options import Config

    return gradagg.demo.demonstrate(Config(**config))[1]  # type: ignore[arg-type]


def _assert_png(path: Path, panels: int = 2) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 500 and height > 200 * panels  # one row of two panels per case, not an empty image
    assert not list(path.parent.glob(".gradagg-*")), "a temporary file of the atomic write was left behind"


@pytest.fixture(scope="module")
def plain_run() -> results.Outcome:
    """Both cases, 3 steps, gradagg's model plain, 3 and 5 microbatches. Steps 1-2 expose the stale replica."""
    return _demonstrate(steps=3, seed=0, counts=(3, 5))


# --- end to end ------------------------------------------------------------------------


def test_demo_gradagg_exact_every_mistake_far_off(plain_run: results.Outcome) -> None:
    """2 ranks with 3 and 5 microbatches: gradagg within 1e-12 (float64) in both cases, each wrong approach
    off by > 1e-3, and the verdict says so."""
    _assert_exact_and_wrong(_summaries(plain_run))
    assert results.passed(plain_run)
    moe = next(c for c in plain_run.cases if c.case == "moe")
    assert "divisor M = 8" in moe.ledger  # M counted over both ranks, 3 + 5
    assert all(a.why for c in plain_run.cases for a in c.approaches)


def test_the_command_exits_0_prints_nothing_on_stderr_and_writes_the_plot(tmp_path: Path) -> None:
    """``python -m gradagg demo``: exit 0, no warning or traceback, the PNG has one row per case."""
    plot = tmp_path / "d.png"
    out = subprocess.run([sys.executable, "-m", "gradagg", "demo", "--steps", "2", "--quiet", "--plot", str(plot)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "gradagg matched the full-batch gradient within 1e-12 at every step of every case" in out.stdout
    _assert_png(plot, panels=2)


def test_token_ledger_counts_every_valid_token(plain_run: results.Outcome) -> None:
    """The token case's divisor D is the valid tokens of step 0 on both ranks, counted here independently
    from the same seeded batch: per rank the first 3 and the last 5 microbatches' non-padding targets."""
    from gradagg.demo.data import mine, token_batch, valid_tokens
    from gradagg.demo.options import Config

    cfg = Config(steps=1, seed=0, counts=(3, 5))
    batch = token_batch(cfg, 0)
    per_rank = [sum(valid_tokens(y) for _, y in mine(cfg, batch, r)) for r in (0, 1)]
    assert per_rank[0] != per_rank[1]  # uneven tokens across ranks, not only uneven counts
    tokens = next(c for c in plain_run.cases if c.case == "tokens")
    assert f"divisor D = total weight = {sum(per_rank)} (per rank: {per_rank})" in tokens.ledger


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_demo_under_each_wrap(wrap: str, plain_run: results.Outcome) -> None:
    """gradagg's model under DDP or FSDP2 (sharded DTensor gradients): still exact in both cases, and it
    trains the same: its final held-out loss equals the plain run's to 1e-9 relative (the wrappers change
    the order of additions only, ~1e-16 per step, over 3 steps). A wrapper that dropped the update would be
    exact every step and still fail here."""
    outcome = _demonstrate(steps=3, seed=0, counts=(3, 5), wrap=wrap)
    assert outcome.wrap == wrap
    got, plain = _summaries(outcome), _summaries(plain_run)
    _assert_exact_and_wrong(got)
    for case in APPROACHES:
        assert got[case][results.GRADAGG][1] == pytest.approx(plain[case][results.GRADAGG][1], rel=1e-9), case


def test_equal_counts_fix_ddp_but_no_token_mistake() -> None:
    """4 and 4 microbatches: DDP's (1/W) sum_r S_r / m_r equals sum S / M, so only uneven counts expose
    it; the token mistakes stay wrong, because valid tokens still differ per microbatch and per rank."""
    rows = _summaries(_demonstrate(steps=2, seed=0, counts=(4, 4)))
    assert rows["moe"]["DDP (W x m_r)"][0] <= results.TOLERANCE
    assert rows["moe"]["divide by participation"][0] > CLEARLY_WRONG  # absent experts: still wrong
    for name in APPROACHES["tokens"][1:]:
        assert rows["tokens"][name][0] > CLEARLY_WRONG, name


def test_demo_exits_1_when_gradagg_misses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo is a check: with a tolerance no error can meet (-1), it says so and returns 1."""
    monkeypatch.setattr(results, "TOLERANCE", -1.0)  # read by the verdict, in this (the parent) process
    assert gradagg.demo.run(_args(tmp_path, "--steps", "1", "--case", "tokens", "--quiet")) == 1
    assert "gradagg DID NOT match" in capsys.readouterr().out


def test_demo_in_a_given_world(tmp_path: Path) -> None:
    """Called on every rank of an initialised 2-rank world (as under torchrun), the demo trains in that
    world instead of starting one; every rank returns the same status, 0, and rank 0 writes the plot."""
    from gradagg.testing import run_local_world

    args = _args(tmp_path, "--steps", "2", "--quiet", "--case", "tokens")
    assert run_local_world(gradagg.demo.run, 2, args, timeout_s=60.0) == [0, 0]
    _assert_png(tmp_path / "out" / "demo.png", panels=1)


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "1"], "at least 2"),
        (["--microbatches", "3,x"], "integers separated by commas"),
        (["--microbatches", "3,5,7"], "expected one per rank (2)"),
        (["--microbatches", "0,5"], "at least 1 microbatch"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--seed", "-1"], "--seed must be between 0 and 2**32 - 1"),
        (["--world-size", "17"], "at most 16 local processes"),
    ],
)
def test_bad_options_raise_before_any_process_starts(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(GradaggError, match=re.escape(message)):
        gradagg.demo.run(_args(tmp_path, *argv))


def test_plot_path_that_is_a_folder_is_refused_up_front(tmp_path: Path) -> None:
    args = _args(tmp_path)
    args.plot = str(tmp_path)
    with pytest.raises(GradaggError, match="is a folder"):
        gradagg.demo.run(args)


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--world-size", "1"], "gradagg: error: --world-size must be at least 2"),
        (["--wrap", "deepspeed"], "gradagg: error: gradagg demo: argument --wrap: invalid choice: 'deepspeed'"),
        (["--case", "vision"], "gradagg: error: gradagg demo: argument --case: invalid choice: 'vision'"),
    ],
)
def test_cli_error_is_one_line_exit_2(argv: list[str], start: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "gradagg", "demo", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(start), proc.stderr


def test_import_is_light() -> None:
    """``import gradagg.demo`` (what ``gradagg demo --help`` needs) loads neither torch nor matplotlib."""
    code = "import sys, gradagg.demo; print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_world_size_0_is_refused_not_replaced_by_2(tmp_path: Path) -> None:
    with pytest.raises(GradaggError, match=r"--world-size must be at least 2, got 0"):
        gradagg.demo.run(_args(tmp_path, "--world-size", "0"))


def _demo_without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``gradagg demo`` in a process where ``import MODULE`` fails, as on a machine without it."""
    code = (f"import sys; sys.modules[{module!r}] = None; from gradagg.cli import main; "
            f"sys.exit(main(['demo', *sys.argv[1:]]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)


def test_without_torch_the_demo_is_one_line_exit_2_with_the_install_hint() -> None:
    proc = _demo_without("torch")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    hint = "pip install -e '.[torch]' in a clone of gradagg"
    assert proc.stderr.startswith(f"gradagg: error: gradagg demo needs torch: {hint}")


def test_without_matplotlib_the_demo_runs_and_says_the_plot_is_skipped(tmp_path: Path) -> None:
    plot = tmp_path / "d.png"
    proc = _demo_without("matplotlib", "--steps", "1", "--case", "tokens", "--quiet", "--plot", str(plot))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "plot: skipped: matplotlib is not installed (pip install matplotlib)" in proc.stdout
    assert not plot.exists()


@pytest.mark.parametrize("when", ["the fork server exists", "a rank exists"])
def test_ctrl_c_while_the_world_starts_is_one_line(when: str) -> None:
    """A terminal's Ctrl-C goes to the whole foreground process group: sent while the fork server imports
    torch, or while the first ranks start, only the command answers, with its one line and exit 130."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "gradagg", "demo", "--steps", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(1200):  # until the command has a child (the fork server), or a grandchild (a rank)
            server = _children(proc.pid)
            if server and (when == "the fork server exists" or any(_children(c) for c in server)):
                break
            time.sleep(0.05)
        time.sleep(0.2)  # past the spawn itself (the server then imports torch for seconds)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
