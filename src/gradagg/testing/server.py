"""The fork server every local world's ranks come from, and the parent's side of starting and ending them."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "gradagg.torch"]


def also_preload(modules: Sequence[str]) -> None:
    """Have the fork server import ``modules`` too, if it starts after this call (once per parent process).

    For a parent that starts many worlds whose ranks import the same heavy modules (a test session: FSDP2's
    and a framework's), each rank then forks them ready instead of importing them again. A module that
    cannot be imported is skipped by the server (``multiprocessing``'s own rule for preloads).
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def context(preload: Sequence[str]) -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # Only effective before the server starts (first world of this process); later worlds reuse it.
    ctx.set_forkserver_preload(_PRELOAD + [m for m in preload if m not in _PRELOAD])
    _start_server_deaf_to_ctrl_c()
    return ctx


def _start_server_deaf_to_ctrl_c() -> None:
    """Start the fork server with SIGINT ignored (a disposition it inherits, and its ranks after it), in
    the standard library's folder.

    The server imports torch for seconds before it sets its own handler; a Ctrl-C meanwhile printed its
    traceback after the parent's one line. The parent alone handles Ctrl-C and ends the ranks. The server
    is ``python -c``, whose ``sys.path`` starts with its working folder: started in the user's, a
    ``random.py`` there shadowed the standard library's (each rank then moves to the parent's folder).
    """
    import multiprocessing.forkserver as forkserver

    here, path = os.getcwd(), os.environ.get("PYTHONPATH")
    # The server preloads gradagg: this gradagg, found by an absolute path wherever the server runs (a
    # relative PYTHONPATH entry would resolve in the standard library's folder there). Each rank then
    # takes the parent's whole sys.path.
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)
    os.chdir(os.path.dirname(os.__file__))
    try:
        if threading.current_thread() is not threading.main_thread():
            forkserver.ensure_running()  # signal handlers can only be changed in the main thread
            return
        # Ignored while the server is spawned: an ignored signal stays ignored across exec (a handler
        # does not), so the server starts deaf to it. A Ctrl-C in those few milliseconds is lost.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, previous)
    finally:
        os.chdir(here)
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C back until every rank has started, so that each one has a pid to be killed by.

    Interrupted halfway, a rank the server had forked but whose pid had not come back went on alone,
    and printed a traceback once this process was gone. Delivered after the block, the interrupt ends
    every rank in :func:`end_sessions`.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be changed in the main thread
        return
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted and callable(previous):
        previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt here


def end_sessions(procs: list[Any]) -> None:
    """Kill what is left of each rank's session (the rank itself on an interrupt; whatever it started).

    A rank's session is named by its pid and lives while any of its processes does, so this reaches a
    child the step left running (which would hold our stdout open), never a process of anyone else.
    """
    for p in procs:
        if p.pid is None:
            continue
        if p.is_alive():
            # Interrupted, or still starting: a rank not yet in its own session (it is unpickling its
            # arguments) would otherwise go on, and print a traceback once this process is gone.
            p.kill()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing of that session is left
        if p.is_alive():
            p.join(timeout=1.0)


