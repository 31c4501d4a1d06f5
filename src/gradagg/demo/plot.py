"""The demo's figure: per case, the held-out loss curves, the close ones' differences, the gradient errors; one PNG."""

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
# A loss curve within 25% of gradagg's at every step lies on or near it at the loss panel's log scale (the token
# mistakes train a differently weighted objective, 0.2% off in loss): those are drawn again in a middle panel, as
# their difference from gradagg's loss, where they come apart.
CLOSE = 0.25


def write_plot(path: str, outcome: Outcome, counts: tuple[int, ...]) -> None:
    """Write the figure to ``path`` atomically (a temporary file, then a rename) as a PNG.

    Args:
        path: the PNG's path; its folder exists (checked before training).
        outcome: rank 0's outcome.
        counts: microbatches per rank, for the title.
    """
    from gradagg.rows.formats.atomic import atomic_path

    fig = figure(outcome, counts)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)  # the temporary name has no .png: say the format


def figure(outcome: Outcome, counts: tuple[int, ...]) -> Any:
    """The figure, on matplotlib's Agg canvas: per case, the loss curves, the differences of those close to
    gradagg's (middle), the gradient errors (right).

    Args:
        outcome: rank 0's outcome.
        counts: microbatches per rank, for the title.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot: no global state).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = len(outcome.cases)
    fig = Figure(figsize=(16, 4.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot's global state
    axes = fig.subplots(rows, 3, squeeze=False)
    for (loss_ax, diff_ax, err_ax), case in zip(axes, outcome.cases):
        _draw_case(loss_ax, err_ax, case)
        _draw_differences(diff_ax, case, _close_to_gradagg(case))
    fig.suptitle(title(outcome, counts))
    return fig


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
    for a in case.approaches:
        style = _style(case, a.name)
        loss_ax.plot([*steps, len(steps)], _losses(case, a.name), label=a.name, **style)
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


def _style(case: CaseResult, name: str) -> dict[str, Any]:
    """gradagg's wide pale line, or a dashed line with a marker of its own for a wrong approach."""
    if name == GRADAGG:
        return GRADAGG_STYLE
    k = [a.name for a in case.approaches].index(name)
    return {"linestyle": "--", "linewidth": 1.2, "marker": MARKERS[(k - 1) % len(MARKERS)], "markersize": 4,
            "zorder": 2 + k}


def _losses(case: CaseResult, name: str) -> list[float]:
    """Held-out loss before each step, then after the last."""
    return [r.loss[name] for r in case.records] + [case.final_loss[name]]


def _close_to_gradagg(case: CaseResult) -> list[str]:
    """The wrong approaches whose loss stays within CLOSE (relative) of gradagg's at every step.

    >>> names = ("gradagg", "a", "b")
    >>> r = CaseResult("tokens", "", [], tuple(results.ApproachInfo(n, n, "") for n in names),
    ...                [results.StepRecord(0, loss={"gradagg": 2.0, "a": 2.01, "b": 3.0})],
    ...                {"gradagg": 1.0, "a": 1.001, "b": 1.0}, "")
    >>> _close_to_gradagg(r)
    ['a']
    """
    ours = _losses(case, GRADAGG)
    return [a.name for a in case.approaches if a.name != GRADAGG and all(
        abs(x - y) <= CLOSE * abs(y) for x, y in zip(_losses(case, a.name), ours))]


def _draw_differences(ax: Any, case: CaseResult, names: list[str]) -> None:
    """``names``' held-out losses minus gradagg's, on a linear scale (gradagg's own: the zero line)."""
    from matplotlib.ticker import MaxNLocator

    ours = _losses(case, GRADAGG)
    steps = list(range(len(ours)))
    for name in (GRADAGG, *names):
        ax.plot(steps, [x - y for x, y in zip(_losses(case, name), ours)], label=name, **_style(case, name))
    ax.set(title=f"{case.case}: loss minus gradagg's, curves within {CLOSE:.0%} of it", xlabel="step",
           ylabel="held-out loss - gradagg's")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if names:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, f"no other curve stays within {CLOSE:.0%} of gradagg's", ha="center",
                transform=ax.transAxes)
