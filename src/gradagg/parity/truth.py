"""The one-process truth, computed in a process of its own under a deadline.

SCRIPT.py's top level, ``build_model()``, ``microbatches()`` and ``full_batch_loss()`` never run in the
``gradagg parity`` process: a script that starts a thread that never ends, a ``build_model()`` that
never returns, or one that changes the working directory or closes a stream would otherwise hang the
command or break its report. The process is a fork of the same server the layouts' ranks come from,
with no process group (as in a plain ``python`` process), and it ends with everything it started.
"""

from __future__ import annotations

import os
from typing import Any

from gradagg.errors import ScriptError, last_line
from gradagg.parity.script import check_loaded, check_script, load_script, takes_size
from gradagg.parity.types import TruthResult
from gradagg.parity.worker import stdout_to_stderr


def compute_truth(script: str, timeout_s: float, preload: tuple[str, ...]) -> TruthResult:
    """Check SCRIPT.py and compute the truth in a fresh process, within ``timeout_s`` seconds.

    Args:
        script: SCRIPT.py's path, as the user gave it (messages name it so).
        timeout_s: the deadline, start-up included.
        preload: modules for the fork server (see :func:`gradagg.testing.launch_local_world`).

    Returns:
        The truth and the digests every rank must reproduce.

    Raises:
        ScriptError: the script is unusable, or checking it hung or ended its process.
    """
    from gradagg.testing import launch_process

    outcome = launch_process(truth_worker, script, os.getcwd(), timeout_s=timeout_s, preload=preload)
    if not outcome.ok:
        raise ScriptError(_failure(script, outcome.error or "", timeout_s))
    result: TruthResult = outcome.value
    if result.failure is not None:
        raise ScriptError(result.failure)
    return result


def compute_truths(script: str, sizes: list[int], timeout_s: float,
                   preload: tuple[str, ...]) -> dict[int | None, TruthResult]:
    """The truth for each number of microbatches in ``sizes``, in one fresh process (``gradagg parity --sweep``).

    Args:
        script: SCRIPT.py's path.
        sizes: how many microbatches to ask ``microbatches(n)`` for.
        timeout_s: the deadline, start-up included.
        preload: modules for the fork server.

    Returns:
        size -> its truth; ``{None: truth}`` alone when ``microbatches()`` takes no size (the window is fixed).

    Raises:
        ScriptError: the script is unusable at some size, or checking it hung or ended its process.
    """
    from gradagg.testing import launch_process

    outcome = launch_process(truths_worker, script, os.getcwd(), sizes, timeout_s=timeout_s, preload=preload)
    if not outcome.ok:
        raise ScriptError(_failure(script, outcome.error or "", timeout_s))
    results: dict[int | None, TruthResult] = outcome.value
    for result in results.values():
        if result.failure is not None:
            raise ScriptError(result.failure)
    return results


def truths_worker(script: str, cwd: str, sizes: list[int]) -> dict[int | None, TruthResult]:
    """The sweep's truth process: every size of the window, or the fixed window when it takes no size."""
    stdout_to_stderr()
    os.chdir(cwd)
    try:
        loaded = load_script(script)
        chosen: list[int | None] = list(sizes) if takes_size(loaded) else [None]
        return {size: _result(check_loaded(loaded, size)) for size in chosen}
    except ScriptError as exc:
        return {None: TruthResult(failure=str(exc))}


def _result(checked: Any) -> TruthResult:
    return TruthResult(None, len(checked.window), checked.grads, checked.model_digest, checked.window_digest,
                       checked.computes_in)


def truth_worker(script: str, cwd: str) -> TruthResult:
    """The truth process: load and check SCRIPT.py in ``cwd``; a :class:`ScriptError` is handed back as text."""
    stdout_to_stderr()
    os.chdir(cwd)
    try:
        checked = check_script(script)
    except ScriptError as exc:
        return TruthResult(failure=str(exc))
    return _result(checked)


def _failure(script: str, error: str, timeout_s: float) -> str:
    last = last_line(error)
    if "deadline" in last:
        return (f"{script}: loading it and computing the full batch did not finish within {timeout_s:g} s: does "
                "its top level, build_model(), microbatches() or full_batch_loss() hang?")
    return f"{script}: the process that loads it and computes the full batch {last.removeprefix('rank 0 ')}"
