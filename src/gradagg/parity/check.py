""":func:`check_parity`: the truth in a process of its own, then one local world per layout, judged here."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gradagg.errors import GradaggError, ScriptError, last_line, require_torch
from gradagg.parity.layouts import check_layouts, default_layouts, format_layout
from gradagg.parity.types import Layout, ParityReport, Truth, TruthResult

DEFAULT_TIMEOUT_S = 60.0  # one world, start-up included: a hung step fails its layout after this long
# A rank blocked in a collective whose peer hangs (without exiting) gives up after this long.
DEFAULT_COLLECTIVE_TIMEOUT_S = 10.0
# DistributedDataParallel imports torch._dynamo on first use, a slow import in every rank of every world;
# the fork server imports it once instead. Only the first world of a process starts the server (the tests' worlds
# preload the same module).
_PRELOAD = ("torch._dynamo",)


def check_parity(
    script: str,
    layouts: Sequence[Sequence[int]] | None = None,
    rtol: float | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> ParityReport:
    """Run SCRIPT.py's ``step`` on one local gloo world per layout and compare every gradient with the truth.

    Args:
        script: path of SCRIPT.py (see the module docstring for what it defines).
        layouts: microbatches per rank, one sequence per layout, each summing to the window; default (None or
            empty): one process, the most even split on 2 ranks, and 1 against the rest (``default_layouts``).
        rtol: the largest relative error that passes; default by the lowest precision the full batch computes in
            (its gradients' dtype, or lower where its operations cast: a float64 model whose loss casts the logits
            to float32 computes in float32): 1e-9 float64, 1e-3 float32, 5e-2 half precision
            (``gradagg.parity.compare.RTOL_BY_DTYPE`` gives the reasons); a layout whose steps ran under
            ``torch.autocast`` in lower precision is judged at that one. A layout whose error is within that
            round-off but above an explicit ``rtol`` is diagnosed as round-off, not as a weighting mistake.
        timeout_s: deadline of each world, start-up included.
        collective_timeout_s: how long a rank waits in a collective for a peer.

    Returns:
        A :class:`ParityReport`; its ``json`` has one observation per layout: ``check``, ``actual`` (the
        largest relative error over ranks and parameters, or what failed), ``expected`` (``"<= rtol"``),
        ``passed``, and ``layout``, ``parameter`` and ``rank`` (where the worst error is), ``ratio`` (the
        one factor between the step's gradients and the truth, when there is one), ``diagnosis``.

    Raises:
        ScriptError: SCRIPT.py cannot be used: missing, does not import, lacks a function, its model or
            window is not deterministic, its full-batch loss has no usable gradient.
        GradaggError: a layout does not sum to the window or has too many ranks; ``rtol`` out of range; torch is
            not installed (said after SCRIPT.py is found, so a missing file is named first).

    Starting processes is not for a doctest, hence the skip (tests/test_parity.py runs it)::

    >>> check_parity("examples/parity/token_mean_by_hand.py").passed  # doctest: +SKIP
    True
    """
    from gradagg.parity.script import check_file  # torch-free: a missing file is named even without torch

    start = time.perf_counter()
    check_file(script)  # at once, before torch is needed and before any process starts
    require_torch("gradagg parity")
    from gradagg.parity.truth import compute_truth

    path = os.path.abspath(script)  # now: the ranks may not share our working folder
    checked = compute_truth(script, timeout_s, _PRELOAD)
    chosen = check_layouts([tuple(layout) for layout in layouts] if layouts else default_layouts(checked.window),
                           checked.window)
    computes_in, truth, tol = truth_and_rtol(checked, rtol)
    observations = [_observe(script, path, layout, truth, (tol, rtol is not None), checked, timeout_s,
                             collective_timeout_s) for layout in chosen]
    return ParityReport(script, checked.window, computes_in.removeprefix("torch."), tol, observations,
                        time.perf_counter() - start)


def truth_and_rtol(checked: TruthResult, rtol: float | None) -> tuple[str, Truth, float]:
    """What the full batch computes in, its :class:`Truth`, and the tolerance: ``rtol``, or by that dtype.

    Raises:
        GradaggError: ``rtol`` out of range.
    """
    from gradagg.parity.compare import RTOL_BY_DTYPE, default_rtol

    computes_in = _computes_in(checked)
    truth = Truth.of(checked.grads, computes_in, RTOL_BY_DTYPE.get(computes_in, 0.0))
    return computes_in, truth, _checked_rtol(max(default_rtol(truth), truth.roundoff) if rtol is None else rtol)


def _checked_rtol(rtol: float) -> float:
    if not (isinstance(rtol, (int, float)) and math.isfinite(rtol) and 0 <= rtol < 1):
        raise GradaggError(f"rtol must be a number from 0 (exact) up to, not including, 1; got {rtol!r} "
                           "(a relative error of 1 is what all-zero gradients have)")
    return float(rtol)


def _lowest_dtype(grads: Mapping[str, Any]) -> str:
    from gradagg.parity.compare import RTOL_BY_DTYPE

    dtypes = sorted({str(g.dtype) for g in grads.values() if g is not None},
                    key=lambda d: RTOL_BY_DTYPE.get(d, 0.0))
    return dtypes[-1]


def _computes_in(checked: TruthResult) -> str:
    """What the full batch computes in: the lower precision of its gradients' dtype and its operations' lowest
    floating dtype (a float64 model whose loss casts the logits to float32 computes in float32)."""
    from gradagg.parity.compare import RTOL_BY_DTYPE

    grads = _lowest_dtype(checked.grads)
    ops = checked.computes_in or grads
    return max((grads, ops), key=lambda d: RTOL_BY_DTYPE.get(d, 0.0))


def _observe(script: str, path: str, layout: Layout, truth: Any, rtol: tuple[float, bool], checked: TruthResult,
             timeout_s: float, collective_timeout_s: float) -> dict[str, Any]:
    """One world for one layout, then its observation."""
    from gradagg.parity.worker import run_rank
    from gradagg.testing import launch_local_world

    outcomes = launch_local_world(run_rank, len(layout), path, layout, os.getcwd(), timeout_s=timeout_s,
                                  collective_timeout_s=collective_timeout_s, preload=_PRELOAD)
    ranks = {o.rank: o.value if o.ok else launcher_failure(o.rank, o.error, timeout_s) for o in outcomes}
    return judge_ranks(script, layout, truth, rtol[0], checked, ranks, explicit=rtol[1])


def judge_ranks(script: str, layout: Layout, truth: Truth, rtol: float, checked: TruthResult,
                ranks: Mapping[int, Any], explicit: bool = False) -> dict[str, Any]:
    """The observation of one layout from what each rank handed back: a RankResult, or why it did not return.

    A step that computed in lower precision under ``torch.autocast`` than the full batch is judged at that
    precision's round-off (its tolerance too, unless ``explicit``: the user's ``rtol``), and the diagnosis says so.

    Raises:
        ScriptError: a rank built another model or window than the truth's.
    """
    from gradagg.parity.compare import judge
    from gradagg.parity.precision import step_precision
    from gradagg.parity.shards import assemble

    results, failures = {}, {}
    for rank, value in sorted(ranks.items()):
        if isinstance(value, str):
            failures[rank] = value
            continue
        _check_same_inputs(script, layout, value, checked)
        if value.failure is not None:
            failures[rank] = value.failure
        else:
            results[rank] = value.grads
    steps = [v.computes_in for v in ranks.values() if not isinstance(v, str)]
    truth, rtol, note = step_precision(truth, rtol, explicit, steps)
    observation = judge(layout, truth, assemble(results), failures, rtol)
    return {**observation, "diagnosis": observation["diagnosis"] + note}


def launcher_failure(rank: int, error: str | None, timeout_s: float) -> str:
    text = last_line(error).removeprefix(f"rank {rank} ")
    if "deadline" in text:
        return f"did not finish within the deadline ({timeout_s:g} s) and was killed: does its step hang?"
    if "SIGABRT" in text:  # no "gloo" or "peer" here: this rank is the cause, not one waiting for another
        text += (" (C++ code aborted it; torch's collectives do that when a rank's collective differs in size "
                 "or kind from the other ranks': the message is on stderr)")
    return text


def _check_same_inputs(path: str, layout: Layout, value: Any, checked: TruthResult) -> None:
    """The model and window each rank built must be the truth's, or the comparison means nothing."""
    from gradagg.parity.digest import first_difference

    model, window = checked.model_digest, checked.window_digest
    where = f"on rank {value.rank} of layout {format_layout(layout)}"
    if value.window_digest and value.window_digest != window:
        raise ScriptError(f"{path}: microbatches() returned different data {where} than in the checking "
                          "process; it must be deterministic in every process")
    differs = first_difference(model, value.model_digest) if value.model_digest else None
    if differs is not None:
        raise ScriptError(f"{path}: build_model() is not deterministic: {differs} differs {where} from the "
                          "model built in the checking process")
