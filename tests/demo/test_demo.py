"""``gradagg demo`` end to end: gradagg at round-off from the full-batch gradient, every wrong approach far off.

The demo starts real gloo worlds on loopback; each run here is 2 or 3 steps, so the file stays near 30 s
on 2 cores (most of it is starting processes). The wrong approaches' formulas are checked in closed form,
without processes, in test_approaches.py; the cases' ground truths in test_cases.py.
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
_ROW = re.compile(r"^(?P<name>\S.*?)\s{2,}(?P<error>\d\.\de[+-]\d\d)\s+(?P<verdict>exact|WRONG)\s+(?P<loss>\S+)\s",
                  re.MULTILINE)


def _args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gradagg.demo.add_arguments(parser)
    return parser.parse_args(["--plot", str(tmp_path / "out" / "demo.png"), *argv])


def _summaries(text: str) -> dict[str, dict[str, tuple[float, str, float]]]:
    """case -> approach -> (max error over steps, verdict, final loss), from each case's summary table."""
    out = {}
    for block in text.split("\n== case ")[1:]:
        case = block.split(":", 1)[0]
        out[case] = {m["name"]: (float(m["error"]), m["verdict"], float(m["loss"])) for m in _ROW.finditer(block)}
        assert list(out[case]) == APPROACHES[case], block
    return out


def _assert_exact_and_wrong(summaries: dict[str, dict[str, tuple[float, str, float]]]) -> None:
    for case, rows in summaries.items():
        error, verdict, _ = rows[results.GRADAGG]
        assert error <= results.TOLERANCE and verdict == "exact", (case, rows)
        for name in APPROACHES[case][1:]:
            assert rows[name][0] > CLEARLY_WRONG and rows[name][1] == "WRONG", (case, name, rows[name])


def _assert_png(path: Path, panels: int = 2) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 500 and height > 200 * panels  # one row of two panels per case, not an empty image
    assert not list(path.parent.glob(".gradagg-*")), "a temporary file of the atomic write was left behind"


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """Both cases, 3 steps, gradagg's model plain: (status, stdout, plot). Steps 1-2 expose the stale replica."""
    tmp = tmp_path_factory.mktemp("plain")
    out = subprocess.run([sys.executable, "-m", "gradagg", "demo", "--steps", "3", "--plot", str(tmp / "d.png")],
                         capture_output=True, text=True, timeout=120)
    assert out.stderr == "", out.stderr  # no warning, no traceback
    return out.returncode, out.stdout, tmp / "d.png"


# --- end to end ------------------------------------------------------------------------


def test_demo_gradagg_exact_every_mistake_far_off(plain_run: tuple[int, str, Path]) -> None:
    """``python -m gradagg demo``, 2 ranks with 3 and 5 microbatches: gradagg within 1e-12 (float64) in
    both cases, each wrong approach off by > 1e-3; exit 0; the PNG has one row per case."""
    status, out, plot = plain_run
    assert status == 0, out
    _assert_exact_and_wrong(_summaries(out))
    assert "divisor M = 8" in out  # the MoE ledger: M counted over both ranks, 3 + 5
    assert "gradagg matched the full-batch gradient within 1e-12 at every step of every case" in out
    for name in APPROACHES["tokens"][1:] + APPROACHES["moe"][1:]:
        assert re.search(rf"^  {re.escape(name)}\s{{2,}}\S", out, re.MULTILINE), f"no 'why' line for {name}"
    _assert_png(plot, panels=2)


def test_token_ledger_counts_every_valid_token(plain_run: tuple[int, str, Path]) -> None:
    """The token case's divisor D is the valid tokens of step 0 on both ranks, counted here independently
    from the same seeded batch: per rank the first 3 and the last 5 microbatches' non-padding targets."""
    from gradagg.demo.data import mine, token_batch, valid_tokens
    from gradagg.demo.options import Config

    cfg = Config(steps=1, seed=0, counts=(3, 5))
    batch = token_batch(cfg, 0)
    per_rank = [sum(valid_tokens(y) for _, y in mine(cfg, batch, r)) for r in (0, 1)]
    assert per_rank[0] != per_rank[1]  # uneven tokens across ranks, not only uneven counts
    assert f"divisor D = total weight = {sum(per_rank)} (per rank: {per_rank})" in plain_run[1]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_demo_under_each_wrap(tmp_path: Path, capsys: pytest.CaptureFixture[str], wrap: str,
                              plain_run: tuple[int, str, Path]) -> None:
    """gradagg's model under DDP or FSDP2 (sharded DTensor gradients): still exact in both cases, and it
    trains the same: its final held-out loss equals the plain run's to the 5 printed decimals (the
    wrappers change the order of additions only, ~1e-16 per step). A wrapper that dropped the update
    would be exact every step and still fail here."""
    assert gradagg.demo.run(_args(tmp_path, "--steps", "3", "--quiet", "--wrap", wrap)) == 0
    out = capsys.readouterr().out
    assert "gradagg's model: " + {"ddp": "DistributedDataParallel", "fsdp": "FSDP2"}[wrap] in out
    got, plain = _summaries(out), _summaries(plain_run[1])
    _assert_exact_and_wrong(got)
    for case in APPROACHES:
        assert got[case][results.GRADAGG][2] == plain[case][results.GRADAGG][2], (case, got[case], plain[case])


def test_equal_counts_fix_ddp_but_no_token_mistake(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """4 and 4 microbatches: DDP's (1/W) sum_r S_r / m_r equals sum S / M, so only uneven counts expose
    it; the token mistakes stay wrong, because valid tokens still differ per microbatch and per rank."""
    assert gradagg.demo.run(_args(tmp_path, "--steps", "2", "--microbatches", "4,4", "--quiet")) == 0
    rows = _summaries(capsys.readouterr().out)
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
