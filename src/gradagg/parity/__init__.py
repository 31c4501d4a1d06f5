"""``gradagg parity``: prove your own distributed training step against the one-process full batch.

SCRIPT.py defines:

* ``build_model() -> torch.nn.Module``, deterministic (identical weights on every call, in every process);
* ``microbatches() -> list``, the global window (any objects), deterministic as well;
* ``full_batch_loss(model, microbatches) -> Tensor``, a scalar whose gradient, in one process over the
  whole window, is the truth;
* ``step(model, microbatches) -> None``, the distributed step under test: called on every rank of a
  local gloo world (the default process group initialised) with that rank's consecutive slice of the
  window; it must leave the synchronized gradient in each parameter's ``.grad`` (a tensor, or a DTensor);
* optionally ``prepare(model) -> model``, called on every rank before ``step`` (wrap in DDP, apply
  ``fully_shard``); ``step`` receives what it returns.

For each layout (microbatches per rank: ``(8,)``, ``(4, 4)``, ``(1, 7)``, ``(0, 8)``) one local world
runs the step; every rank's gradients, read by name from the parameters of the model that
``build_model()`` returned (a DTensor's put together from every rank's shard in this process, with no
collective after the step: :mod:`gradagg.parity.shards`), are compared with the truth,
parameter by parameter (the relative error is defined in :mod:`gradagg.parity.compare`). A layout
passes when the largest relative error over ranks and parameters is at most ``rtol``. A step that
raises, exits or hangs on some rank fails its layout, within the world's deadline: a rank whose step
fails returns at once, so a peer blocked in a collective with it fails fast, and a rank that hangs is
killed at the deadline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradagg.errors import GradaggError, ScriptError
from gradagg.parity.layouts import MAX_RANKS, Layout, check_layouts, default_layouts, format_layout, parse_layout

__all__ = ["MAX_RANKS", "ParityReport", "ScriptError", "add_arguments", "check_parity", "run"]

DEFAULT_TIMEOUT_S = 60.0  # one world, start-up included: a hung step fails its layout after this long
# A rank blocked in a collective whose peer hangs (without exiting) gives up after this long.
DEFAULT_COLLECTIVE_TIMEOUT_S = 10.0
# DistributedDataParallel imports torch._dynamo on first use, 2 s per rank and world; the fork server
# imports it once instead. Only the first world of a process starts the server (the tests' worlds
# preload the same module).
_PRELOAD = ("torch._dynamo",)


@dataclass(frozen=True)
class ParityReport:
    """The outcome of :func:`check_parity`.

    Attributes:
        script: SCRIPT.py's path.
        window: M, the microbatches that ``microbatches()`` returned.
        dtype: the lowest-precision dtype among the truth's gradients (what the default rtol is for).
        rtol: the tolerance used.
        observations: one per layout, in the ``gradagg verify`` form (see :func:`check_parity`).
        elapsed_s: seconds the whole check took.
    """

    script: str
    window: int
    dtype: str
    rtol: float
    observations: list[dict[str, Any]]
    elapsed_s: float

    @property
    def passed(self) -> bool:
        """Whether every layout passed."""
        return all(o["passed"] for o in self.observations)

    @property
    def json(self) -> dict[str, Any]:
        """``{"observations": [...], "passed": bool}``: what ``gradagg parity`` prints."""
        return {"observations": self.observations, "passed": self.passed}


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
        rtol: the largest relative error that passes; default by dtype: 1e-9 float64, 1e-3 float32,
            5e-2 half precision (``gradagg.parity.compare.RTOL_BY_DTYPE`` gives the reasons).
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
        GradaggError: a layout does not sum to the window or has too many ranks; ``rtol`` out of range.

    Starting processes is not for a doctest, hence the skip (tests/test_parity.py runs it)::

    >>> check_parity("examples/parity/token_mean_by_hand.py").passed  # doctest: +SKIP
    True
    """
    start = time.perf_counter()
    _require_torch()
    from gradagg.parity.compare import Truth, default_rtol
    from gradagg.parity.script import check_script

    checked = check_script(script)
    window = len(checked.window)
    chosen = check_layouts([tuple(layout) for layout in layouts] if layouts else default_layouts(window), window)
    truth = Truth.of(checked.grads)
    tol = _checked_rtol(default_rtol(truth) if rtol is None else rtol)
    inputs = (checked.model_digest, checked.window_digest)
    observations = [_observe(script, layout, truth, tol, inputs, timeout_s, collective_timeout_s) for layout in chosen]
    return ParityReport(script, window, _lowest_dtype(truth.grads), tol, observations, time.perf_counter() - start)


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise GradaggError("gradagg parity needs torch: pip install 'gradagg[torch]'") from None


def _checked_rtol(rtol: float) -> float:
    if not (isinstance(rtol, (int, float)) and math.isfinite(rtol) and 0 <= rtol < 1):
        raise GradaggError(f"rtol must be a number from 0 (exact) up to, not including, 1; got {rtol!r} "
                           "(a relative error of 1 is what all-zero gradients have)")
    return float(rtol)


def _lowest_dtype(grads: Mapping[str, Any]) -> str:
    from gradagg.parity.compare import RTOL_BY_DTYPE

    dtypes = sorted({str(g.dtype) for g in grads.values() if g is not None},
                    key=lambda d: RTOL_BY_DTYPE.get(d, 0.0))
    return dtypes[-1].removeprefix("torch.")


def _observe(script: str, layout: Layout, truth: Any, rtol: float, inputs: tuple[dict[str, str], str],
             timeout_s: float, collective_timeout_s: float) -> dict[str, Any]:
    """One world for one layout, then its observation."""
    path = os.path.abspath(script)  # the ranks may not share our working folder
    from gradagg.parity.compare import judge
    from gradagg.parity.shards import assemble
    from gradagg.parity.worker import run_rank
    from gradagg.testing import launch_local_world

    outcomes = launch_local_world(run_rank, len(layout), path, layout, timeout_s=timeout_s,
                                  collective_timeout_s=collective_timeout_s, preload=_PRELOAD)
    results, failures = {}, {}
    for o in outcomes:
        if not o.ok:
            failures[o.rank] = _launcher_failure(o.rank, o.error, timeout_s)
            continue
        _check_same_inputs(script, layout, o.value, inputs)
        if o.value.failure is not None:
            failures[o.rank] = o.value.failure
        else:
            results[o.rank] = o.value.grads
    return judge(layout, truth, assemble(results), failures, rtol)


def _launcher_failure(rank: int, error: str | None, timeout_s: float) -> str:
    lines = [ln.strip() for ln in (error or "").strip().splitlines() if ln.strip()]
    text = (lines[-1] if lines else "failed").removeprefix(f"rank {rank} ")
    if "deadline" in text:
        return f"did not finish within the deadline ({timeout_s:g} s) and was killed: does its step hang?"
    if "SIGABRT" in text:  # no "gloo" or "peer" here: this rank is the cause, not one waiting for another
        text += (" (C++ code aborted it; torch's collectives do that when a rank's collective differs in size "
                 "or kind from the other ranks': the message is on stderr)")
    return text


def _check_same_inputs(path: str, layout: Layout, value: Any, inputs: tuple[dict[str, str], str]) -> None:
    """The model and window each rank built must be this process's, or the comparison means nothing."""
    from gradagg.parity.digest import first_difference

    model, window = inputs
    where = f"on rank {value.rank} of layout {format_layout(layout)}"
    if value.window_digest and value.window_digest != window:
        raise ScriptError(f"{path}: microbatches() returned different data {where} than in the checking "
                          "process; it must be deterministic in every process")
    differs = first_difference(model, value.model_digest) if value.model_digest else None
    if differs is not None:
        raise ScriptError(f"{path}: build_model() is not deterministic: {differs} differs {where} from the "
                          "model built in the checking process")


# --- the command line ---------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``gradagg parity SCRIPT.py [--layouts L [L ...]] [--rtol R]`` to ``parser``."""
    parser.add_argument("script", metavar="SCRIPT.py",
                        help="defines build_model(), microbatches(), full_batch_loss(model, microbatches), "
                             "step(model, microbatches) and optionally prepare(model)")
    parser.add_argument("--layouts", nargs="+", metavar="L",
                        help="microbatches per rank, e.g. 8 4,4 1,7 0,8; each must sum to the window (default: one "
                             f"process, an even and an uneven split on 2 ranks); at most {MAX_RANKS} ranks")
    parser.add_argument("--rtol", type=float, metavar="R",
                        help="largest relative error that passes, per parameter: ||g - t|| / max(||t||, 1%% of the "
                             "whole gradient's norm) (default: 1e-9 for float64 models, 1e-3 for float32)")


def run(args: argparse.Namespace) -> int:
    """Run ``gradagg parity``: the observations as JSON on stdout, a summary on stderr when it is a terminal.

    Returns:
        0 when every layout passed, 1 otherwise.

    Raises:
        GradaggError: SCRIPT.py cannot be used, or bad options (the command line exits 2 with one line).
    """
    from gradagg.parity.report import summary

    layouts = [parse_layout(text) for text in args.layouts] if args.layouts else None
    report = check_parity(args.script, layouts, args.rtol)
    print(json.dumps(report.json, ensure_ascii=False, allow_nan=False))
    if sys.stderr.isatty():
        print(summary(report), file=sys.stderr)
    return 0 if report.passed else 1
