"""The human summary of ``gradagg parity`` (stderr, when it is a terminal): one block per layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradagg.parity.layouts import format_layout

if TYPE_CHECKING:
    from gradagg.parity.types import ParityReport


def summary(report: ParityReport) -> str:
    """Per layout: pass or FAIL, the worst parameter and rank, and what a miss looks like.

    Args:
        report: what :func:`gradagg.parity.check_parity` returned.

    Returns:
        The summary, several lines.
    """
    width = max(len(format_layout(tuple(o["layout"]))) for o in report.observations)
    lines = [f"gradagg parity {report.script}: {report.window} microbatches, {report.dtype}, rtol {report.rtol:g}"]
    for o in report.observations:
        lines.extend(_layout_lines(o, width))
    passed = sum(o["passed"] for o in report.observations)
    lines.append(f"{passed} of {len(report.observations)} layouts passed ({report.elapsed_s:.1f} s)")
    return "\n".join(lines)


def _layout_lines(o: dict[str, Any], width: int) -> list[str]:
    head = f"  layout {format_layout(tuple(o['layout'])):<{width}}  {'pass' if o['passed'] else 'FAIL'}  "
    if isinstance(o["actual"], float | int):
        head += f"max relative error {o['actual']:.2g} ({o['parameter']}, rank {o['rank']})"
        return [head] if o["passed"] else [head, " " * 4 + o["diagnosis"]]
    return [head + str(o["diagnosis"])]
