"""``gradagg parity --sweep``: the factor per cell of a grid of worlds and microbatches per rank.

The examples' window is 16 variable-length sequences (95 valid tokens); ``microbatches(n)`` splits the same
rows into n microbatches, so every cell has the same float64 truth. Each expected factor below follows
from the step's arithmetic: a right mode is exact everywhere; GRPO's mean of microbatch means is exact
exactly where every microbatch holds as many sequences (16 rows in 1, 2, 4 or 8) and off where they do
not (3, 6, 12); a generation batch twice the window is 0.5x everywhere; DDP's average over a global
divisor is 1/W; the Dr. GRPO sums never divided are |S| x NORM = 16 x 12 = 192x. Grids are kept small (one
world per world size runs all its cells; each world costs a second or two on a loaded machine).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gradagg import cli
from gradagg.parity.sweep import Cell, _Run, fixed_cells, sized_cells, uneven_layout

torch = pytest.importorskip("torch")

from gradagg.parity import ScriptError  # noqa: E402
from gradagg.parity.sweep import sweep_parity, table  # noqa: E402
from gradagg.parity.types import RankResult  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "parity"
FIXTURES = Path(__file__).resolve().parent / "scripts"
FAST = {"timeout_s": 30.0, "collective_timeout_s": 3.0}


def _factors(report: Any) -> dict[tuple[int, ...], str]:
    return {tuple(o["layout"]): o["factor"] for o in report.observations}


def test_a_right_mode_is_exact_on_every_cell_of_the_default_grid() -> None:
    """token-mean through the accumulator: 1, 2, 3 ranks x 1, 2, 4 microbatches each, even and uneven."""
    report = sweep_parity(str(EXAMPLES / "mode_token_mean.py"))
    assert set(_factors(report)) == {c.layout for c in sized_cells([1, 2, 3], [1, 2, 4])}
    assert report.passed and set(_factors(report).values()) == {"exact"}, table(report)
    assert report.dtype == "float64" and report.rtol == 1e-9 and report.sized


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_every_other_right_mode_is_exact_on_three_uneven_ranks(mode: str) -> None:
    """One world each: 3 ranks, 1 and 2 microbatches each, a rank with none included (0,1,2)."""
    report = sweep_parity(str(EXAMPLES / f"mode_{mode}.py"), [3], [1, 2])
    assert set(_factors(report).values()) == {"exact"} and report.dtype == "float64", table(report)


def test_grpo_mean_of_microbatch_means_is_off_only_where_the_rows_split_unequally() -> None:
    """2 ranks: 2 or 4 microbatches of 8 or 4 sequences, exact; 3 ranks: 3 or 6 unequal ones, no single factor."""
    report = sweep_parity(str(EXAMPLES / "mistake_grpo_mean_of_microbatch_means.py"), [2, 3], [1, 2])
    factors = _factors(report)
    assert all(factors[c] == "exact" for c in [(1, 1), (0, 2), (2, 2), (1, 3)]), table(report)
    for layout in [(1, 1, 1), (0, 1, 2), (2, 2, 2), (1, 2, 3)]:
        low, high = (float(f.removesuffix("x")) for f in factors[layout].split(".."))
        assert 1 < low < high < 1.5, table(report)  # a longer sequence's tokens outweigh in a smaller microbatch
    assert not report.passed


@pytest.mark.parametrize(("example", "worlds", "per_rank", "expected"), [
    ("mistake_dapo_generation_batch_count", [1, 2], [1], {(1,): "0.5x", (1, 1): "0.5x", (0, 2): "0.5x"}),
    ("mistake_ddp_average_and_global_tokens", [2, 3], [2],
     {(2, 2): "0.5x", (1, 3): "0.5x", (2, 2, 2): "0.333x (1/3)", (1, 2, 3): "0.333x (1/3)"}),
    ("mistake_dr_grpo_no_division", [1], [1, 4], {(1,): "192x", (4,): "192x"}),
])
def test_a_mistake_reports_its_factor_per_cell(example: str, worlds: list[int], per_rank: list[int],
                                               expected: dict[tuple[int, ...], str]) -> None:
    report = sweep_parity(str(EXAMPLES / f"{example}.py"), worlds, per_rank)
    assert _factors(report) == expected, table(report)
    assert all(o["ratio"] is not None for o in report.observations) and not report.passed


def test_a_failed_cell_ends_its_world_and_the_cells_after_it_run_in_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises on a rank with no microbatch: those cells FAIL, the others stay exact; two worlds."""
    import gradagg.testing

    worlds: list[int] = []
    launch = gradagg.testing.launch_local_world
    monkeypatch.setattr(gradagg.testing, "launch_local_world",
                        lambda fn, n, *a, **kw: worlds.append(len(a[1])) or launch(fn, n, *a, **kw))
    report = sweep_parity(str(FIXTURES / "sized_raises_on_empty_rank.py"), [2], [1, 2], **FAST)
    assert worlds == [4, 2], "cells per world: all four, then the two after the failed one"
    assert _factors(report) == {(1, 1): "exact", (0, 2): "FAIL", (2, 2): "exact", (1, 3): "exact"}, table(report)
    failed = report.observations[1]
    assert "rank 0: step() raised ValueError: this rank has no microbatch" in failed["diagnosis"]
    assert "world 2, layout 0,2: rank 0: step() raised ValueError" in table(report)


def test_a_window_that_takes_no_size_sweeps_the_layouts_of_its_fixed_window() -> None:
    report = sweep_parity(str(FIXTURES / "right.py"), [1, 2], [4], **FAST)
    assert not report.sized and _factors(report) == {(4,): "exact", (2, 2): "exact", (1, 3): "exact"}
    assert "fixed window: microbatches() takes no n" in table(report)


def test_a_full_batch_that_depends_on_the_split_is_refused() -> None:
    with pytest.raises(ScriptError, match=r"full_batch_loss\(\) gives another gradient when the window is split"):
        sweep_parity(str(FIXTURES / "sized_truth_depends_on_split.py"), [1, 2], [1, 2])


# --- the command line ------------------------------------------------------------------------------


def test_the_command_prints_the_table_and_exits_1_on_a_factor(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    out_json = tmp_path / "sweep.json"
    status = cli.main(["parity", "--sweep", str(EXAMPLES / "mistake_dapo_generation_batch_count.py"),
                       "--worlds", "2", "--per-rank", "1", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 1
    assert out.splitlines()[2].split() == ["2", "1,1", "2", "0.5x"] and "0 of 2 cells exact" in out
    data = json.loads(out_json.read_text())
    assert data["passed"] is False and [o["factor"] for o in data["observations"]] == ["0.5x", "0.5x"]
    assert {"check", "actual", "expected", "passed", "layout", "ratio", "diagnosis"} <= set(data["observations"][0])


def test_the_command_exits_0_when_every_cell_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["parity", "--sweep", str(EXAMPLES / "mode_token_mean.py"), "--worlds", "2",
                       "--per-rank", "1", "--json", "-"])
    assert status == 0 and json.loads(capsys.readouterr().out)["passed"] is True


@pytest.mark.parametrize(("argv", "message"), [
    (["--sweep", "--layouts", "4"], "--layouts and --sweep: choose one"),
    (["--sweep", "--worlds", "9"], "--worlds: a world of 9 ranks; from 1 to 8"),
    (["--sweep", "--worlds", "0"], "--worlds: a world of 0 ranks"),
    (["--sweep", "--per-rank", "0"], "--per-rank: 0 microbatches per rank"),
    (["--sweep", "--per-rank", "1,x"], "--per-rank '1,x': expected whole numbers"),
    (["--worlds", "2"], "--worlds is an option of --sweep"),
    (["--json", "-"], "--json is an option of --sweep"),
])
def test_bad_sweep_options_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["parity", str(FIXTURES / "right.py"), *argv])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.startswith("gradagg: error: ") and err.count("\n") == 1 and message in err, err


# --- the grid and the world logic, without worlds -----------------------------------------------------


def test_the_grid_spreads_evenly_and_unevenly() -> None:
    assert [uneven_layout(w, k) for w, k in [(2, 1), (2, 4), (3, 1), (3, 2)]] == [(0, 2), (2, 6), (0, 1, 2), (1, 2, 3)]
    cells = sized_cells([1, 2, 3], [1, 2, 4])
    assert len(cells) == 15 and all(sum(c.layout) == c.size == len(c.layout) * c.size // len(c.layout)
                                    for c in cells)
    assert all(sum(c.layout) == 10 and c.size is None for c in fixed_cells([1, 2, 3, 4], 10))


class _FakeRun(_Run):
    """A world per launch, drawn at random: each rank finishes a prefix of the cells, fails one, or is killed."""

    def __init__(self, rng: random.Random, world: int) -> None:
        super().__init__("s.py", "/s.py", {}, {}, 1e-9, 1.0, 1.0)
        object.__setattr__(self, "rng", rng)
        object.__setattr__(self, "size", world)
        object.__setattr__(self, "launches", [])

    def _launch(self, cells: list[Cell]) -> dict[int, Any]:
        self.launches.append(list(cells))
        fail_at = self.rng.randrange(len(cells) + 2)  # past the end: no cell fails in this world
        values: dict[int, Any] = {}
        for rank in range(self.size):
            if self.rng.random() < 0.2:
                values[rank] = "was killed at the deadline"
                continue
            ran = [RankResult(rank) for _ in cells[: fail_at + 1]]
            if fail_at < len(cells) and self.rng.random() < 0.7:
                ran[-1].failure = "step() raised"
            values[rank] = ran[: fail_at + 1] if fail_at < len(cells) else ran
        return values

    def _observe(self, cell: Cell, ranks: dict[int, Any]) -> dict[str, Any]:
        assert set(ranks) == set(range(self.size))
        return {"cell": cell}


def test_every_cell_is_observed_once_whatever_fails_and_worlds_stay_bounded() -> None:
    """Fuzz the world logic: failed cells, killed ranks, clean worlds; seeded, the seed printed on failure."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(300):
        world = rng.choice([1, 2, 3])
        cells = [Cell((k,) * world, k * world) for k in range(1, rng.randrange(1, 7) + 1)]
        run = _FakeRun(rng, world)
        observed = run.world(cells)
        assert [o["cell"] for o in observed] == cells, f"seed {seed}"
        assert len(run.launches) <= 2 * len(cells), f"seed {seed}: {len(run.launches)} worlds for {len(cells)} cells"
