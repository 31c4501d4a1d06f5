"""``gradagg parity --sweep``: one step over a grid of world sizes and microbatches per rank, one factor per cell.

A **cell** is a world size W, microbatches per rank k, and how they are spread: evenly (k on every
rank) or unevenly (``uneven_layout``: rank 0 gets k // 2, none when k is 1, the last rank the rest), so
the window holds n = W x k microbatches. When SCRIPT.py's ``microbatches`` takes a number,
``microbatches(n)`` splits the same rows into n microbatches: the microbatch size and the accumulation
count change together, the rows never do, so every cell has the same one-process truth (checked: a
``full_batch_loss()`` whose gradient depends on the split is refused). When it takes none, the window
is fixed and the grid varies the world and the layout only.

Each cell is judged by :func:`gradagg.parity.compare.judge`, with the tolerance
:func:`gradagg.parity.check.truth_and_rtol` derives from the dtype the full batch computes in, and reported
as ``exact``, or the factor between its gradients and the truth (``0.5x``, ``4x``), or the range of
factors when there is no single one, or ``FAIL`` (a rank raised, hung, left a gradient out).

Cost: one process computes every size's truth; then one world per world size runs all of its cells in
turn (:func:`gradagg.parity.worker.run_cells`). A cell that fails on some rank ends that world; the
cells after it run in a new one, so a failure costs at most one world per cell.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradagg.errors import GradaggError, ScriptError
from gradagg.parity.check import DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_TIMEOUT_S
from gradagg.parity.layouts import MAX_RANKS, check_layouts, format_layout
from gradagg.parity.types import Layout, TruthResult, Verdict

DEFAULT_WORLDS = (1, 2, 3)
DEFAULT_PER_RANK = (1, 2, 4)
MAX_PER_RANK = 16  # a sweep checks splits, not throughput: more microbatches per rank show nothing new
# A world runs several cells; each gets this much time on top of the first's deadline (a step of a parity
# script runs in well under a second; a cell that hangs still ends the world, and only that world).
_PER_EXTRA_CELL_S = 10.0


@dataclass(frozen=True)
class Cell:
    """One point of the grid: its layout, and how many microbatches to ask for (None: the fixed window)."""

    layout: Layout
    size: int | None


@dataclass(frozen=True)
class SweepReport(Verdict):
    """The outcome of :func:`sweep_parity`.

    Attributes:
        script: SCRIPT.py's path.
        sized: whether ``microbatches(n)`` took a size (else the window was fixed).
        dtype: what the full batch computes in; rtol: the tolerance used.
        observations: one per cell, :func:`gradagg.parity.compare.judge`'s form plus ``world``,
            ``microbatches`` and ``factor`` (``"exact"``, ``"0.5x"``, ``"0.79x..1.2x"``, ``"FAIL"``).
        elapsed_s: seconds the whole sweep took.
    """

    script: str
    sized: bool
    dtype: str
    rtol: float
    observations: list[dict[str, Any]]
    elapsed_s: float


def uneven_layout(world: int, per_rank: int) -> Layout:
    """The uneven spread of ``world * per_rank`` microbatches: rank 0 gets ``per_rank // 2``, the last the rest.

    >>> uneven_layout(2, 1), uneven_layout(3, 4)
    ((0, 2), (2, 4, 6))
    """
    first = per_rank // 2
    return (first, *([per_rank] * (world - 2)), 2 * per_rank - first)


def sized_cells(worlds: Sequence[int], per_rank: Sequence[int]) -> list[Cell]:
    """The grid when ``microbatches(n)`` takes a size: per world and per count, the even and the uneven spread.

    >>> [c.layout for c in sized_cells([1, 2], [1])]
    [(1,), (1, 1), (0, 2)]
    """
    cells: list[Cell] = []
    for world in worlds:
        for k in per_rank:
            for layout in [(k,) * world] + ([uneven_layout(world, k)] if world > 1 else []):
                if Cell(layout, world * k) not in cells:
                    cells.append(Cell(layout, world * k))
    return cells


def fixed_cells(worlds: Sequence[int], window: int) -> list[Cell]:
    """The grid when the window is fixed (``microbatches()`` takes no size): per world, an even and an uneven spread.

    >>> [c.layout for c in fixed_cells([1, 2, 3], 8)]
    [(8,), (4, 4), (2, 6), (3, 3, 2), (1, 4, 3)]
    """
    layouts: list[Layout] = []
    for world in worlds:
        even = tuple(window // world + (r < window % world) for r in range(world))
        first = window // (2 * world)
        rest = window - first
        uneven = (first, *(rest // (world - 1) + (r < rest % (world - 1)) for r in range(world - 1))) \
            if world > 1 else even
        layouts.extend([even, uneven])
    return [Cell(layout, None) for layout in check_layouts(layouts, window)]


def sweep_parity(
    script: str,
    worlds: Sequence[int] | None = None,
    per_rank: Sequence[int] | None = None,
    rtol: float | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> SweepReport:
    """Run SCRIPT.py's ``step`` on every cell of the grid and say, per cell, by what factor it is off the truth.

    Args:
        script: SCRIPT.py (see :mod:`gradagg.parity`); ``microbatches(n)`` may take the number of microbatches.
        worlds: world sizes (default 1, 2, 3), each from 1 to ``MAX_RANKS``.
        per_rank: microbatches per rank (default 1, 2, 4), each from 1 to ``MAX_PER_RANK``; ignored when
            ``microbatches()`` takes no size.
        rtol: as for :func:`gradagg.parity.check_parity` (default: by the dtype the full batch computes in).
        timeout_s: deadline of a world's first cell, start-up included (each further cell adds 10 s).
        collective_timeout_s: how long a rank waits in a collective for a peer.

    Returns:
        A :class:`SweepReport`.

    Raises:
        ScriptError: SCRIPT.py cannot be used at some size, or its full batch depends on the split.
        GradaggError: a world size or count out of range, ``rtol`` out of range, torch missing.

    >>> sweep_parity("examples/parity/mode_token_mean.py").passed  # doctest: +SKIP
    True
    """
    from gradagg.errors import require_torch
    from gradagg.parity.script import check_file

    start = time.perf_counter()
    worlds, per_rank = check_grid(worlds or DEFAULT_WORLDS, per_rank or DEFAULT_PER_RANK)
    check_file(script)
    require_torch("gradagg parity --sweep")
    from gradagg.parity.check import _PRELOAD, truth_and_rtol
    from gradagg.parity.truth import compute_truths

    sized = sized_cells(worlds, per_rank)
    truths = compute_truths(script, sorted({c.size for c in sized if c.size is not None}), timeout_s, _PRELOAD)
    cells = fixed_cells(worlds, truths[None].window) if None in truths else sized
    judged = {size: truth_and_rtol(t, rtol) for size, t in truths.items()}
    tol = max(j[2] for j in judged.values())
    _check_same_truth(script, truths, judged, tol)
    run = _Run(script, os.path.abspath(script), truths, {s: j[1] for s, j in judged.items()}, tol, timeout_s,
               collective_timeout_s, rtol is not None)
    observations = [o for world in worlds for o in run.world([c for c in cells if len(c.layout) == world])]
    dtype = max(judged.values(), key=lambda j: j[2])[0].removeprefix("torch.")
    return SweepReport(script, None not in truths, dtype, tol, observations, time.perf_counter() - start)


def check_grid(worlds: Sequence[int], per_rank: Sequence[int]) -> tuple[list[int], list[int]]:
    """The grid's world sizes and counts, checked and deduplicated (order kept).

    Raises:
        GradaggError: a world size outside 1..``MAX_RANKS``, or a count outside 1..``MAX_PER_RANK``.
    """
    for w in worlds:
        if not 1 <= w <= MAX_RANKS:
            raise GradaggError(f"--worlds: a world of {w} ranks; from 1 to {MAX_RANKS} local processes")
    for k in per_rank:
        if not 1 <= k <= MAX_PER_RANK:
            raise GradaggError(f"--per-rank: {k} microbatches per rank; from 1 to {MAX_PER_RANK} (an uneven "
                               "spread gives a rank none already)")
    return list(dict.fromkeys(worlds)), list(dict.fromkeys(per_rank))


def _check_same_truth(script: str, truths: Mapping[int | None, TruthResult], judged: Mapping[Any, Any],
                      tol: float) -> None:
    """Every split of the window must have the same full-batch gradient: the same rows, in one process."""
    from gradagg.parity.compare import compare_rank

    sizes = sorted(s for s in truths if s is not None)
    for size in sizes[1:]:
        misses = compare_rank(0, truths[size].grads, judged[sizes[0]][1])
        worst = max(misses, key=lambda m: m.key)
        if worst.key > tol:
            raise ScriptError(f"{script}: full_batch_loss() gives another gradient when the window is split into "
                              f"{size} microbatches than into {sizes[0]} ({worst.name!r} differs by {worst.error:.2g} "
                              "relative): microbatches(n) must split the same rows, and the full batch must not "
                              "depend on the split")


@dataclass(frozen=True)
class _Run:
    script: str
    path: str
    truths: Mapping[int | None, TruthResult]
    truth: Mapping[int | None, Any]
    rtol: float
    timeout_s: float
    collective_timeout_s: float
    explicit: bool = False  # the user gave rtol: a step under autocast widens only the diagnosis of round-off

    def world(self, cells: list[Cell]) -> list[dict[str, Any]]:
        """Every cell of one world size, in order: one world for all, a new one after a cell that failed."""
        done: dict[Cell, dict[str, Any]] = {}
        pending = list(cells)
        while pending:
            values = self._launch(pending)
            complete = all(not isinstance(v, str) for v in values.values())
            failed = _first_failed(values)
            if failed is None and not complete:  # a rank handed back nothing, and no other says where
                values = self._launch(pending[:1]) if len(pending) > 1 else values
                failed = 0
            last = len(pending) - 1 if failed is None else failed
            for i, cell in enumerate(pending[: last + 1]):
                if i == failed or complete:  # a killed rank's finished cells are lost with it: they run again
                    done[cell] = self._observe(cell, {r: _at(v, i) for r, v in values.items()})
            pending = [c for c in pending if c not in done]
        return [done[c] for c in cells]

    def _launch(self, cells: list[Cell]) -> dict[int, Any]:
        from gradagg.parity.check import _PRELOAD, launcher_failure
        from gradagg.parity.worker import run_cells
        from gradagg.testing import launch_local_world

        deadline = self.timeout_s + _PER_EXTRA_CELL_S * (len(cells) - 1)
        outcomes = launch_local_world(run_cells, len(cells[0].layout), self.path,
                                      [(c.layout, c.size) for c in cells], os.getcwd(), timeout_s=deadline,
                                      collective_timeout_s=self.collective_timeout_s, preload=_PRELOAD)
        return {o.rank: o.value if o.ok else launcher_failure(o.rank, o.error, deadline) for o in outcomes}

    def _observe(self, cell: Cell, ranks: dict[int, Any]) -> dict[str, Any]:
        from gradagg.parity.check import judge_ranks

        truth = self.truth[cell.size]
        o = judge_ranks(self.script, cell.layout, truth, self.rtol, self.truths[cell.size], ranks, self.explicit)
        grads = {r: v.grads for r, v in ranks.items() if not isinstance(v, str) and v.failure is None}
        factor = factor_text(o, truth, grads)
        size = cell.size if cell.size is not None else sum(cell.layout)
        return {**o, "world": len(cell.layout), "microbatches": size, "factor": factor}


def _first_failed(values: Mapping[int, Any]) -> int | None:
    """The first cell that some returned rank failed; None when none did (a killed rank says nothing of where)."""
    ends = [next((i for i, r in enumerate(v) if r.failure is not None), None)
            for v in values.values() if not isinstance(v, str)]
    located = [i for i in ends if i is not None]
    return min(located) if located else None


def _at(value: Any, index: int) -> Any:
    """What a rank handed back for one cell: its RankResult, or why it has none (killed, stopped earlier)."""
    if isinstance(value, str):
        return value
    return value[index] if index < len(value) else "stopped at an earlier cell"


def factor_text(o: Mapping[str, Any], truth: Any, grads: Mapping[int, Any]) -> str:
    """A cell's verdict in a few characters: ``exact``, ``0.5x``, ``0.79x..1.2x`` (no single factor), ``FAIL``."""
    from gradagg.parity.compare import projections
    from gradagg.parity.shards import assemble

    if o["passed"]:
        return "exact"
    if o["ratio"] is not None:
        return _times(o["ratio"])
    if str(o["diagnosis"]).startswith("round-off"):
        return "round-off"
    if o["parameter"] is None or not isinstance(o["actual"], (int, float)) or not math.isfinite(o["actual"]):
        return "FAIL"
    ratios = [r for g in assemble(grads).values() for r in projections(truth, g)[0]]
    return f"{_times(min(ratios))}..{_times(max(ratios))}" if ratios else "FAIL"


def _times(ratio: float) -> str:
    """``0.5x``, ``4x``, ``0.333x (1/3)``."""
    text = f"{ratio:.3g}x"
    if 0 < ratio < 1:
        k = round(1 / ratio)
        if k >= 3 and abs(k * ratio - 1) <= 1e-3:  # 1/3 and below read better as a fraction (1/world, 1/CP)
            text += f" (1/{k})"
    return text


def table(report: SweepReport) -> str:
    """The human table: one line per cell (world, layout, microbatches, factor), why each FAIL failed, a count.

    Args:
        report: what :func:`sweep_parity` returned.

    Returns:
        The table, several lines, for stdout.
    """
    rows = [("world", "layout", "microbatches", "gradient vs one-process full batch")]
    rows += [(str(o["world"]), format_layout(tuple(o["layout"])), str(o["microbatches"]), o["factor"])
             for o in report.observations]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    window = "microbatches(n) splits the same rows" if report.sized else "fixed window: microbatches() takes no n"
    lines = [f"gradagg parity --sweep {report.script}: {report.dtype}, exact within rtol {report.rtol:g}; {window}"]
    lines += ["  " + "  ".join(f"{c:<{w}}" for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    lines += [f"  world {o['world']}, layout {format_layout(tuple(o['layout']))}: {o['diagnosis']}"
              for o in report.observations if o["factor"] == "FAIL"]
    exact = sum(o["passed"] for o in report.observations)
    lines.append(f"{exact} of {len(report.observations)} cells exact ({report.elapsed_s:.1f} s)")
    return "\n".join(lines)
