"""The rank side of ``gradagg parity``: what every process of a local world runs.

:func:`run_rank` is the worker that :func:`gradagg.testing.launch_local_world` starts (a module-level
function, so that each rank can import it by name). It imports SCRIPT.py from its path, builds the
model, lets ``prepare`` wrap it, runs ``step`` on this rank's consecutive slice of the window and
reads every parameter's gradient by name from the model that ``build_model()`` returned: a DTensor's
as this rank's shard (:func:`gradagg.parity.shards.piece_of`), an FSDP1 parameter's as this rank's piece
(:mod:`gradagg.parity.fsdp1`), put together in the checking process.

A failure in the user's code is caught and returned, so the rank exits at once: a peer waiting
for it in a collective then fails fast (its connection closes) instead of waiting out the timeout.
Nothing is sent after ``step()`` returns, so a rank that ran fewer collectives than its peers
returns at once too, and its peers fail in the step that waits for it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any

from gradagg.parity import fsdp1
from gradagg.parity.digest import data_digest, model_digest
from gradagg.parity.layouts import rank_slice
from gradagg.parity.precision import DtypesSeen
from gradagg.parity.script import describe, load_script, read_grad, user_state
from gradagg.parity.shards import piece_of
from gradagg.parity.types import Layout, Piece, RankResult

if TYPE_CHECKING:
    import torch


def run_rank(path: str, layout: Layout, cwd: str) -> RankResult:
    """Run SCRIPT.py's step on this rank's share of the window; return its gradients (never raises).

    Args:
        path: SCRIPT.py, an absolute path.
        layout: microbatches per rank; this rank runs ``layout[rank]`` consecutive ones.
        cwd: the checker's working directory, where each of the script's functions runs.

    Returns:
        The rank's :class:`RankResult`.
    """
    stdout_to_stderr()
    return _run(path, layout, None, cwd)


def run_cells(path: str, cells: list[tuple[Layout, int | None]], cwd: str) -> list[RankResult]:
    """``gradagg parity --sweep``'s worker: several cells, in order, on one world; never raises.

    Each cell is a layout and the number of microbatches to ask ``microbatches(n)`` for (None:
    ``microbatches()``), with a model of its own from ``build_model()``. A barrier before each cell but the
    first keeps one cell's collectives from pairing with the next one's. This rank stops at its first failed
    cell, so a peer waiting for it fails fast, as in :func:`run_rank`.

    Args:
        path: SCRIPT.py, an absolute path.
        cells: (layout, size) per cell; every layout has as many ranks as the world.
        cwd: the checker's working directory.

    Returns:
        One :class:`RankResult` per cell run: all of them, or up to and including the first that failed.
    """
    import torch.distributed as dist

    stdout_to_stderr()
    results: list[RankResult] = []
    for index, (layout, size) in enumerate(cells):
        if index:
            try:
                dist.barrier()
            except BaseException as exc:  # the previous cell's collectives did not pair up: this one fails
                results.append(RankResult(dist.get_rank(), failure=f"waiting for the other ranks raised "
                                          f"{describe(exc)}"))
                break
        results.append(_run(path, layout, size, cwd))
        if results[-1].failure is not None:
            break
    return results


def _run(path: str, layout: Layout, size: int | None, cwd: str) -> RankResult:
    """One step on this rank: load, window (``microbatches(size)`` unless None), model, prepare, step, read."""
    import torch.distributed as dist

    rank = dist.get_rank()
    result = RankResult(rank=rank)
    phase = "loading the script"
    try:
        os.chdir(cwd)
        script = load_script(path)
        phase = "microbatches()" if size is None else f"microbatches({size})"
        with user_state(cwd):
            window = list(script.module.microbatches(*(() if size is None else (size,))))
        result.window_digest = data_digest(window)
        phase = "build_model()"
        with user_state(cwd):
            model = script.module.build_model()
        result.model_digest = model_digest(model)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # FSDP1 flattens them
        phase = "prepare()"
        wrapped = _prepared(script.module, model, cwd) if script.has_prepare else model
        phase = "step()"
        # a step under autocast is judged at its precision
        with user_state(cwd), DtypesSeen(autocast_only=True) as autocast:
            script.module.step(wrapped, window[rank_slice(layout, rank)])
        result.computes_in = autocast.lowest()
        phase = "reading the gradients"  # locally: a DTensor's shard, not full_tensor() (a collective)
        unit = fsdp1.fsdp1_in(wrapped)
        result.grads = (dict(fsdp1.read(model, unit, shapes)) if unit is not None
                        else {name: _read(p) for name, p in model.named_parameters()})
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: whatever stops the user's code
        result.failure = f"{phase} raised {describe(exc)}{_where(exc, path)}"
    return result


def _read(param: torch.Tensor) -> torch.Tensor | Piece | None:
    grad = param.grad
    return piece_of(grad) if grad is not None and hasattr(grad, "device_mesh") else read_grad(param)


def _prepared(module: Any, model: Any, cwd: str) -> Any:
    with user_state(cwd):
        wrapped = module.prepare(model)
    if wrapped is None:
        raise ValueError("prepare(model) returned None; it must return the model, wrapped or not")
    return wrapped


def _where(exc: BaseException, path: str) -> str:
    """`` (at SCRIPT.py line 12)``: the deepest frame of the traceback that is in the user's script."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == path]
    return f" (at {os.path.basename(path)} line {frames[-1].lineno})" if frames else ""


def stdout_to_stderr() -> None:
    """Point this process's file descriptor 1 at 2: the parent's stdout carries the observations' JSON only.

    Also when the parent runs with its stdout closed (``sys.stdout`` is None here then).
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.dup2(2, 1)
