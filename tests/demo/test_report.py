"""The demo's report and plot from hand-made result objects (no processes): columns that hold, a plot that
shows every curve, names its axes and says what gradagg's model was."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradagg.demo import report
from gradagg.demo.options import WRAP_NAMES
from gradagg.demo.results import GRADAGG, ApproachInfo, CaseResult, Outcome, StepRecord

APPROACHES = (ApproachInfo(GRADAGG, GRADAGG, "right"), ApproachInfo("diverges", "diverges", "wrong"),
              ApproachInfo("same as gradagg", "same", "wrong, but not at these steps"))


def _case(final_diverging: float) -> CaseResult:
    records = [StepRecord(k, loss={GRADAGG: 1.0, "diverges": 10.0 ** (4 * k), "same as gradagg": 1.0},
                          error={GRADAGG: 1e-16, "diverges": 1.0, "same as gradagg": 1e-16},
                          off={GRADAGG: [], "diverges": ["w"], "same as gradagg": []}, scale=1.0) for k in range(3)]
    final = {GRADAGG: 0.5, "diverges": final_diverging, "same as gradagg": 0.5}
    return CaseResult("tokens", "t", [], APPROACHES, records, final, "ledger")


@pytest.mark.parametrize("loss", [1.05e16, float("inf"), float("nan"), -3.0e-12, 123456.789])
def test_the_summary_columns_hold_whatever_the_loss(capsys: pytest.CaptureFixture[str], loss: float) -> None:
    """A diverging approach's final loss is written in exponent form: every row of the table keeps its width."""
    report.print_summary(_case(loss))
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("approach"))
    rows = lines[header + 1: header + 1 + len(APPROACHES)]
    column = lines[header].index("parameters off")
    assert all(row[column - 2: column] == "  " and row[column] != " " for row in rows), rows


def test_fit_keeps_its_width_and_its_value() -> None:
    for x in (0.0, 1.5, 1.05e16, -1.05e16, 1e-300, 99999.99999, float("-inf")):
        text = report.fit(x, 10)
        assert len(text) == 10 and (float(text) == pytest.approx(x, rel=1e-3) or x != x), (x, text)


def test_the_plot_shows_every_curve_names_its_axes_and_the_wrap(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from gradagg.demo import plot

    path = tmp_path / "d.png"
    plot.write_plot(str(path), Outcome([_case(1e16)], "ddp", 2), (3, 5))
    assert path.read_bytes()[:4] == b"\x89PNG"
    fig = Figure()
    FigureCanvasAgg(fig)
    loss_ax, err_ax = fig.subplots(1, 2)
    plot._draw_case(loss_ax, err_ax, _case(1e16))
    for ax in (loss_ax, err_ax):
        assert ax.get_xlabel() == "step" and ax.get_ylabel(), ax.get_title()
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert [a.name for a in APPROACHES] == labels[:3]
        lines = {line.get_label(): line for line in ax.get_lines()}
        # the curve equal to gradagg's is drawn over it, with markers: it cannot hide under it
        assert lines["same as gradagg"].get_zorder() > lines[GRADAGG].get_zorder()
        assert lines["same as gradagg"].get_marker() not in (None, "None", "")
    assert plot.title(Outcome([], "ddp", 2), (3, 5)).endswith(f"gradagg's copy of the model: {WRAP_NAMES['ddp']}")
