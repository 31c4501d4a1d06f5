"""``gradagg demo``: gradagg at round-off from the full-batch gradient, every known wrong approach far off.

The demo starts real gloo worlds on loopback; each run here is a few steps, so the file stays near
20 s on 2 cores (most of it is starting processes). The combination formulas of the wrong
approaches are also checked in closed form, without processes.
"""

from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gradagg import demo
from gradagg.errors import GradaggError

torch = pytest.importorskip("torch")

WRONG = demo.APPROACHES[1:]
# A wrong approach must miss by far more than round-off: its smallest max-error in these runs is ~0.1.
# 1e-3 is 9 orders of magnitude above the tolerance and 2 below what the mistakes produce.
CLEARLY_WRONG = 1e-3
_SUMMARY = re.compile(r"^(?P<name>.+?)\s{2,}(?P<error>\d\.\de[+-]\d\d)\s+(?P<verdict>exact|WRONG)\s", re.MULTILINE)


def _args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(["--plot", str(tmp_path / "out" / "demo.png"), *argv])


def _summary(text: str) -> dict[str, tuple[float, str]]:
    """approach -> (max error over steps, verdict), from the demo's summary table."""
    rows = {m["name"]: (float(m["error"]), m["verdict"]) for m in _SUMMARY.finditer(text)}
    assert set(rows) == set(demo.APPROACHES), text
    return rows


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 500 and height > 200  # the two-panel figure, not an empty image
    assert not list(path.parent.glob(".gradagg-*")), "a temporary file of the atomic write was left behind"


# --- end to end ------------------------------------------------------------------------


def test_demo_gradagg_exact_every_mistake_far_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """2 ranks with 3 and 5 microbatches: gradagg within 1e-12 (float64), each mistake off by > 1e-3.

    3 steps: on step 0 the replica mistakes happen to be right (no stale copy yet); steps 1-2 expose them.
    """
    status = demo.run(_args(tmp_path, "--steps", "3"))
    out = capsys.readouterr().out
    assert status == 0, out
    rows = _summary(out)
    assert rows[demo.GRADAGG][0] <= demo.TOLERANCE and rows[demo.GRADAGG][1] == "exact"
    for name in WRONG:
        assert rows[name][0] > CLEARLY_WRONG and rows[name][1] == "WRONG", (name, rows[name])
    assert "divisor M = 8" in out  # the ledger: M counted over both ranks, 3 + 5
    _assert_png(tmp_path / "out" / "demo.png")


def test_demo_even_counts_make_ddp_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """4 and 4 microbatches: DDP's (1/W) sum_r S_r / m_r equals sum S / M, so only uneven counts expose it."""
    assert demo.run(_args(tmp_path, "--steps", "3", "--microbatches", "4,4", "--quiet")) == 0
    rows = _summary(capsys.readouterr().out)
    assert rows["DDP (W x m_r)"][0] <= demo.TOLERANCE
    assert rows["divide by participation"][0] > CLEARLY_WRONG  # absent experts: still wrong


def test_demo_exits_1_when_gradagg_misses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo is a check: with a tolerance no error can meet (-1), it says so and returns 1."""
    monkeypatch.setattr(demo, "TOLERANCE", -1.0)  # read by the verdict, in this (the parent) process
    assert demo.run(_args(tmp_path, "--steps", "1", "--quiet")) == 1
    assert "gradagg DID NOT match" in capsys.readouterr().out


def test_demo_in_a_given_world(tmp_path: Path) -> None:
    """Called on every rank of an initialised 2-rank world (as under torchrun), the demo trains in that
    world instead of starting one; every rank returns the same status, 0, and rank 0 writes the plot."""
    from gradagg.testing import run_local_world

    statuses = run_local_world(demo.run, 2, _args(tmp_path, "--steps", "3", "--quiet"), timeout_s=60.0)
    assert statuses == [0, 0]
    _assert_png(tmp_path / "out" / "demo.png")


@pytest.mark.skipif(not Path(demo.__file__).with_name("cli.py").exists(), reason="the CLI is not there yet")
def test_cli_demo_subprocess(tmp_path: Path) -> None:
    """``python -m gradagg demo`` end to end: exit 0, the summary on stdout, the PNG written."""
    plot = tmp_path / "loss.png"
    proc = subprocess.run(
        [sys.executable, "-m", "gradagg", "demo", "--steps", "3", "--quiet", "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _summary(proc.stdout)[demo.GRADAGG][0] <= demo.TOLERANCE
    _assert_png(plot)


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
        demo.run(_args(tmp_path, *argv))


def test_plot_path_that_is_a_folder_is_refused_up_front(tmp_path: Path) -> None:
    args = _args(tmp_path)
    args.plot = str(tmp_path)
    with pytest.raises(GradaggError, match="is a folder"):
        demo.run(args)


def test_cli_error_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gradagg", "demo", "--world-size", "1"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("gradagg: error: --world-size must be at least 2")


# --- the wrong approaches in closed form ----------------------------------------------------


def _local(sums: dict[str, float], present: dict[str, int], count: int, stale: float | None = None) -> demo._Local:
    t = {n: torch.tensor([v], dtype=torch.float64) for n, v in sums.items()}
    return demo._Local(t, present, count, None if stale is None else torch.tensor([stale], dtype=torch.float64))


def _two_ranks() -> list[demo._Local]:
    """Rank 0: 3 microbatches; "w" got gradient 1 in each (sum 3), "e" got 4 in one, head_b a stale 7.
    Rank 1 (owner of head_b): 5 microbatches; "w" got 2 in each (sum 10), "e" absent, head_b 1 in each."""
    return [
        _local({"w": 3.0, "e": 4.0, demo.HEAD: 0.0}, {"w": 3, "e": 1, demo.HEAD: 0}, 3, stale=7.0),
        _local({"w": 10.0, "e": 0.0, demo.HEAD: 5.0}, {"w": 5, "e": 0, demo.HEAD: 5}, 5),
    ]


def _values(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float(g) for n, g in grads.items()}


def test_exact_mean_is_sum_over_m() -> None:
    """M = 8: w = 13/8, e = 4/8 (absent counts as zero), head_b = 5/8 (only the owner computes it)."""
    assert _values(demo._exact(_two_ranks())) == {"w": 13 / 8, "e": 0.5, demo.HEAD: 5 / 8}


def test_divide_by_participation_is_off_for_the_absent_expert_only() -> None:
    """w was present in all 8: right; e in 1 of 8: 4/1 instead of 4/8; head_b in 5: 5/5 instead of 5/8."""
    assert _values(demo._by_participation(_two_ranks(), owner=1)) == {"w": 13 / 8, "e": 4.0, demo.HEAD: 1.0}


def test_ddp_averages_rank_means() -> None:
    """(S_0 / 3 + S_1 / 5) / 2: w = (1 + 2) / 2 = 1.5 instead of 13/8."""
    got = _values(demo._ddp(_two_ranks(), owner=1))
    assert got == pytest.approx({"w": 1.5, "e": 4 / 3 / 2, demo.HEAD: 0.5})


def test_replica_mistakes_read_the_stale_copy() -> None:
    """head_b: the owner's 5/8 plus rank 0's stale 7 when summed; the stale 7 alone when rank 0 comes first."""
    assert _values(demo._sum_every_replica(_two_ranks(), owner=1))[demo.HEAD] == 7 + 5 / 8
    assert _values(demo._first_replica(_two_ranks(), owner=1))[demo.HEAD] == 7.0


def test_pack_unpack_round_trip() -> None:
    """What the wrong approaches gather is exactly what each rank computed, stale copy or none."""
    like = {n: torch.zeros(1, dtype=torch.float64) for n in ("w", "e", demo.HEAD)}
    for local in _two_ranks():
        back = demo._unpack(demo._pack(local), like)
        assert _values(back.sums) == _values(local.sums)
        assert (back.present, back.count) == (local.present, local.count)
        assert (back.stale is None) == (local.stale is None)
