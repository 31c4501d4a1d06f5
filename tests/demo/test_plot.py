"""The demo's figure: every approach's loss curve can be told from every other one's, in one of its loss panels."""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any

import pytest

from gradagg.demo import plot
from gradagg.demo.results import GRADAGG, ApproachInfo, CaseResult, Outcome, StepRecord

pytest.importorskip("matplotlib")

SEPARATED = 0.03  # two curves are told apart where, at some step, they are 3% of an axes' height apart
TOKENS = ("mean of token means", "local tokens x W", "divide by M")


def _case(offsets: dict[str, float], steps: int = 20) -> CaseResult:
    """A tokens-like case: gradagg's loss decays from 4.2 to ~1.5; each other approach's is gradagg's times
    (1 + its offset x the step's fraction), as the demo's mean of token means and local tokens x W are
    (final losses 1.51417 and 1.50932 against gradagg's 1.51068: 0.2% apart)."""
    names = (GRADAGG, *offsets)
    base = [1.5 + 2.7 * math.exp(-k / 4) for k in range(steps + 1)]
    loss = {n: [b * (1 + offsets.get(n, 0.0) * k / steps) for k, b in enumerate(base)] for n in names}
    records = [StepRecord(k, loss={n: loss[n][k] for n in names}, error={n: 1e-16 if n == GRADAGG else 0.05
                                                                            for n in names}) for k in range(steps)]
    return CaseResult("tokens", "", [], tuple(ApproachInfo(n, n[:11], "") for n in names), records,
                      {n: loss[n][steps] for n in names}, "")


def _separated(ax: Any, a: Any, b: Any) -> bool:
    """Whether lines ``a`` and ``b`` of ``ax`` are SEPARATED apart (in axes height) at some shared x."""
    ya = dict(zip(a.get_xdata(), a.get_ydata(), strict=True))
    yb = dict(zip(b.get_xdata(), b.get_ydata(), strict=True))
    shared = sorted(set(ya) & set(yb))
    to_axes = ax.transData + ax.transAxes.inverted()
    pa = to_axes.transform([(x, ya[x]) for x in shared])
    pb = to_axes.transform([(x, yb[x]) for x in shared])
    return bool(max(abs(p[1] - q[1]) for p, q in zip(pa, pb, strict=True)) >= SEPARATED)


def _loss_axes(fig: Any) -> list[Any]:
    """The first row's loss panels: the losses, and the differences from gradagg's."""
    return fig.axes[:2]


@pytest.mark.parametrize("offsets", [
    {TOKENS[0]: 0.0023, TOKENS[1]: -0.001, TOKENS[2]: -0.6},  # the demo's tokens case, in shape (divide by M: far)
    {TOKENS[0]: 0.01, TOKENS[1]: 0.02},
    {TOKENS[0]: -0.5, TOKENS[1]: 0.8},  # far apart: no inset needed, and they must still be told apart
])
def test_every_pair_of_loss_curves_is_told_apart_somewhere(offsets: dict[str, float]) -> None:
    fig = plot.figure(Outcome([_case(offsets)], "none", 2), (3, 5))
    fig.canvas.draw()
    axes = _loss_axes(fig)
    names = [GRADAGG, *offsets]
    for a, b in combinations(names, 2):
        assert any(_separated(ax, *_lines(ax, a, b)) for ax in axes if _has(ax, a, b)), (a, b, offsets)


def _has(ax: Any, *names: str) -> bool:
    labels = {line.get_label() for line in ax.get_lines()}
    return all(n in labels for n in names)


def _lines(ax: Any, *names: str) -> list[Any]:
    by = {line.get_label(): line for line in ax.get_lines()}
    return [by[n] for n in names]
