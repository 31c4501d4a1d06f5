"""The demo's figure: per case, the held-out loss curves (left) and the gradient errors (right), one PNG."""

from __future__ import annotations

from typing import Any

from gradagg.demo import results
from gradagg.demo.options import WRAP_NAMES
from gradagg.demo.results import GRADAGG, CaseResult, Outcome

ZERO_ON_LOG = 1e-18  # an exact 0 has no place on a log axis: drawn here, below anything float64 round-off makes
# gradagg's curve is drawn first, wide and pale, and the others on top of it, thin and marked: a wrong approach
# that matches gradagg at some steps (the replica mistakes before a replica is stale, DDP's means on even
# counts) stays visible instead of hiding under it.
GRADAGG_STYLE = {"color": "0.25", "linewidth": 5.0, "alpha": 0.45, "zorder": 1}
MARKERS = "os^vDP*X"


def write_plot(path: str, outcome: Outcome, counts: tuple[int, ...]) -> None:
    """Write the figure to ``path`` atomically (a temporary file, then a rename) as a PNG.

    Args:
        path: the PNG's path; its folder exists (checked before training).
        outcome: rank 0's outcome.
        counts: microbatches per rank, for the title.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from gradagg.rows.formats.atomic import atomic_path

    rows = len(outcome.cases)
    fig = Figure(figsize=(11, 4.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot's global state
    axes = fig.subplots(rows, 2, squeeze=False)
    for (loss_ax, err_ax), case in zip(axes, outcome.cases):
        _draw_case(loss_ax, err_ax, case)
    fig.suptitle(title(outcome, counts))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)  # the temporary name has no .png: say the format


def title(outcome: Outcome, counts: tuple[int, ...]) -> str:
    """The figure's title: the world, the counts, and what gradagg's model copy was (``--wrap``, in words).

    >>> title(Outcome([], "none", 2), (3, 5))
    "gradagg demo: 2 ranks, microbatches per rank [3, 5], float64; gradagg's copy of the model: a plain module"
    """
    return (f"gradagg demo: {outcome.world_size} ranks, microbatches per rank {list(counts)}, float64; "
            f"gradagg's copy of the model: {WRAP_NAMES[outcome.wrap]}")


def _draw_case(loss_ax: Any, err_ax: Any, case: CaseResult) -> None:
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in case.records]
    for k, a in enumerate(case.approaches):
        style: dict[str, Any] = GRADAGG_STYLE if a.name == GRADAGG else {
            "linestyle": "--", "linewidth": 1.2, "marker": MARKERS[(k - 1) % len(MARKERS)], "markersize": 4,
            "zorder": 2 + k}
        losses = [r.loss[a.name] for r in case.records] + [case.final_loss[a.name]]  # before each step, then after
        loss_ax.plot([*steps, len(steps)], losses, label=a.name, **style)
        err_ax.plot(steps, [max(r.error[a.name], ZERO_ON_LOG) for r in case.records], label=a.name, **style)
    err_ax.axhline(results.TOLERANCE, color="grey", linewidth=1, linestyle=":",
                   label=f"tolerance {results.TOLERANCE:.0e}")
    # Log scales: a diverging run and round-off (1e-16) share the axes with everything in between.
    loss_ax.set(title=f"{case.case}: held-out loss, each approach training its own copy", xlabel="step",
                ylabel="held-out loss (log scale)", yscale="log")
    err_ax.set(title=f"{case.case}: gradient error at each step, all ranks", xlabel="step",
               ylabel="max |gradient - full-batch gradient| (log)", yscale="log")
    for ax in (loss_ax, err_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, loc="best")
