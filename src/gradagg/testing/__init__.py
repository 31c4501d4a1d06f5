"""Local worlds for tests, demos and ``gradagg parity``: N gloo processes, started fast.

Not part of the training API: training code uses the world ``torchrun`` (or
any launcher) gives it. This module starts one on one machine and collects
what each rank returns. Design choices, each for a trap met in practice:

* **forkserver with torch preloaded**: the server imports torch once; each rank
  is a fork of it (a fork instead of an ``import torch`` per rank). The
  server is started once per parent process and reused by every later world.
* **the server's environment is frozen** when it starts, so each rank receives
  what it needs explicitly: the parent's *current* ``sys.path`` (pytest's
  ``pythonpath``, a script's folder) and any extra environment variables, both
  applied before the worker function is imported. The worker is named by
  module and qualified name, and its arguments travel pickled, for that reason.
* **loopback only**: the rendezvous store listens on 127.0.0.1 (a free port
  chosen by the OS, held by the parent: no port race) and gloo is bound to the
  loopback interface (``GLOO_SOCKET_IFNAME``).
* **short collective timeout**: start-up (every rank reaching the rendezvous
  store) gets ``timeout_s``; the process group is created only then, with
  ``collective_timeout_s``, so that a dead peer turns into an error within
  seconds, never a hang.
* results come back on a queue that each rank flushes (``join_thread``)
  before ``os._exit``, which skips interpreter teardown (it can block on a
  process group whose peer died).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradagg.errors import CollectiveError
from gradagg.testing.guard import check_main_guard, reference
from gradagg.testing.rank import rank_main

_PRELOAD = ["torch", "torch.distributed", "gradagg.torch"]
_GRACE_S = 5.0  # after the deadline, how long a rank may take to exit before it is killed


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of a local world ended.

    Attributes:
        rank: the rank.
        value: what the worker function returned (None if it failed).
        error: None on success; else the worker's traceback, or how the process died.
        exitcode: the process exit code (None if it had to be killed after the deadline).
    """

    rank: int
    value: Any
    error: str | None
    exitcode: int | None

    @property
    def ok(self) -> bool:
        """Whether the worker returned normally.

        >>> RankOutcome(rank=1, value=None, error="rank 1 exited with code 3 without returning a result", exitcode=3).ok
        False
        """
        return self.error is None


def launch_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    collective_timeout_s: float = 5.0,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    preload: Sequence[str] = (),
) -> list[RankOutcome]:
    """Run ``fn(*args)`` on ``world_size`` local processes joined in one process group; never raises for a rank.

    Each rank calls ``fn(*args)`` after ``torch.distributed`` is initialised
    (``dist.get_rank()`` tells it which rank it is). ``fn`` must be a module-level
    function of an importable module (a script's own functions work too when the
    script is run by path: its folder is on ``sys.path``).

    Args:
        fn: the worker, module-level; its return value must be picklable.
        world_size: number of ranks, 1 or more.
        *args: picklable arguments, the same for every rank.
        backend: ``"gloo"`` (CPU). ``"nccl"`` needs one GPU per rank.
        collective_timeout_s: the process group's timeout once every rank has joined.
        timeout_s: the deadline for the whole world, start-up included.
        env: extra environment variables for the ranks, set before ``fn`` is imported. Variables that
            torch reads only when it is imported are already fixed in the fork server (started once, with
            the parent's environment at that time); ``TORCH_DISTRIBUTED_DEBUG`` is re-read for you.
        preload: more modules for the fork server to import once, besides torch (e.g. ``"torch._dynamo"``,
            which ``DistributedDataParallel`` imports on first use, slowly, in every rank). Only the first
            world of a process starts the server, so pass the same list every time.

    Returns:
        One :class:`RankOutcome` per rank, in rank order.

    Raises:
        CollectiveError: ``fn`` cannot be named from another process.

    Starting processes is not for a doctest, hence the skip (the tests run it)::

    >>> outcomes = launch_local_world(dist.get_rank, 2)  # doctest: +SKIP
    >>> [(o.rank, o.ok, o.value) for o in outcomes]  # doctest: +SKIP
    [(0, True, 0), (1, True, 1)]
    """
    check_main_guard()
    ref = reference(fn)
    ctx = _context(preload)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    spec = (ref, world_size, store.port, backend, collective_timeout_s, timeout_s, list(sys.path), dict(env or {}),
            os.getcwd())
    outcomes = _run_processes(ctx, spec, pickle.dumps(args), world_size, timeout_s)
    del store  # the rendezvous store lives exactly as long as the world
    return outcomes


def launch_process(fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
                   preload: Sequence[str] = ()) -> RankOutcome:
    """Run ``fn(*args)`` in one fresh process of the fork server, with no process group, under a deadline.

    For code that must not run in this process: it may hang (killed at the deadline), start threads
    that never end, change the working directory or close its streams. The process runs in a session
    of its own, ended with the call, so nothing it started outlives it.

    Args:
        fn: a module-level function of an importable module; its return value must be picklable.
        *args: picklable arguments.
        timeout_s: the deadline, start-up included.
        preload: as for :func:`launch_local_world`.

    Returns:
        Its :class:`RankOutcome` (rank 0).

    >>> launch_process(os.getpid).ok  # doctest: +SKIP
    True
    """
    check_main_guard()
    spec: tuple[Any, ...] = (reference(fn), 1, 0, None, 0.0, timeout_s, list(sys.path), {}, os.getcwd())
    return _run_processes(_context(preload), spec, pickle.dumps(args), 1, timeout_s)[0]


def _run_processes(ctx: Any, spec: tuple[Any, ...], blob: bytes, n: int, timeout_s: float) -> list[RankOutcome]:
    """Start ``n`` ranks, collect their results until the deadline, then end their sessions, whatever happened."""
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(rank, spec, blob, results), daemon=True) for rank in range(n)]
    try:
        with _ctrl_c_deferred():
            for p in procs:
                p.start()
        got, killed = _collect(results, procs, time.monotonic() + timeout_s)
        return [_outcome(rank, got.get(rank), procs[rank], rank in killed) for rank in range(n)]
    finally:
        _end_sessions(procs)


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C back until every rank has started, so that each one has a pid to be killed by.

    Interrupted halfway, a rank the server had forked but whose pid had not come back went on alone,
    and printed a traceback once this process was gone. Delivered after the block, the interrupt ends
    every rank in :func:`_end_sessions`.
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


def _end_sessions(procs: list[Any]) -> None:
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


def run_local_world(fn: Callable[..., Any], world_size: int, *args: Any, **options: Any) -> list[Any]:
    """Like :func:`launch_local_world`, but return the values and raise if any rank failed.

    Args:
        fn: the worker (see :func:`launch_local_world`).
        world_size: number of ranks.
        *args: arguments for ``fn``.
        **options: ``backend``, ``collective_timeout_s``, ``timeout_s``, ``env``, ``preload``.

    Returns:
        What each rank returned, in rank order.

    Raises:
        CollectiveError: one or more ranks raised, died or missed the deadline; the message names
            each failed rank with its error and ends with their tracebacks.

    >>> run_local_world(dist.get_world_size, 2)  # doctest: +SKIP
    [2, 2]
    """
    outcomes = launch_local_world(fn, world_size, *args, **options)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        heads = "; ".join(f"rank {o.rank}: {_last_line(o.error)}" for o in failed)
        tails = "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in failed)
        raise CollectiveError(f"{len(failed)} of {world_size} ranks failed in {_name(fn)}: {heads}\n{tails}")
    return [o.value for o in outcomes]


def launched_by_torchrun() -> bool:
    """Whether this process is a rank that ``torchrun`` (or another launcher) started: its world is in the environment.

    >>> launched_by_torchrun()  # the doctest runs in a plain process
    False
    """
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, **options: Any) -> list[Any]:
    """Run ``fn(*args)`` in the world ``torchrun`` gave this process, or else in a new local world.

    Under ``torchrun`` every rank runs this same call: it joins the launcher's world (initialising the
    default process group from the environment if nobody did, and destroying it afterwards), runs ``fn``
    once and returns ``[its own value]``. In a plain process it is :func:`run_local_world` (every rank's
    value). Examples use it so that ``python example.py`` and ``torchrun --nproc-per-node N example.py``
    both work and neither starts a world inside another.

    Args:
        fn: the worker (see :func:`launch_local_world`).
        world_size: the ranks ``fn`` expects; under ``torchrun`` the launcher's must match.
        *args: arguments for ``fn``.
        **options: as for :func:`run_local_world`; under ``torchrun`` only ``backend`` and
            ``collective_timeout_s`` apply.

    Returns:
        Under ``torchrun``: this rank's value, in a list of one; else every rank's value, in rank order.

    Raises:
        CollectiveError: the launcher's world has another size; a local rank failed.
    """
    if not launched_by_torchrun():
        return run_local_world(fn, world_size, *args, **options)
    own = not dist.is_initialized()
    if own:
        timeout = datetime.timedelta(seconds=float(options.get("collective_timeout_s", 60.0)))
        dist.init_process_group(options.get("backend", "gloo"), timeout=timeout)
    try:
        if dist.get_world_size() != world_size:
            raise CollectiveError(f"this needs {world_size} ranks; the launcher started {dist.get_world_size()}")
        return [fn(*args)]
    finally:
        if own:
            dist.destroy_process_group()


# --- parent side -------------------------------------------------------------


def _context(preload: Sequence[str]) -> Any:
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


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _collect(results: Any, procs: list[Any], deadline: float) -> tuple[dict[int, tuple[bool, Any]], set[int]]:
    """Each rank's (ok, payload) as it arrives until the deadline; then the ranks killed for missing it."""
    got: dict[int, tuple[bool, Any]] = {}
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.05)
            got[rank] = (ok, payload)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                _drain(results, got)  # every rank exited: one last look for results flushed just before exit
                return got, set()
    killed: set[int] = set()
    for rank, p in enumerate(procs):
        # The grace after the deadline; once a rank is killed, one it held in a collective gets a second to
        # fail and exit by itself.
        grace = min(_GRACE_S, max(0.0, deadline + _GRACE_S - time.monotonic()))
        p.join(timeout=max(grace, 1.0 if killed else 0.1))
        if p.is_alive():
            p.kill()  # ours, past the deadline
            p.join(timeout=1.0)
            killed.add(rank)
    if len(got) < len(procs):
        # A rank that waited for a killed one (on a group with torch's 30-minute timeout) fails once its peer
        # is gone, after the deadline: its result is in the pipe all the same.
        _drain(results, got)
    return got, killed


def _drain(results: Any, got: dict[int, tuple[bool, Any]]) -> None:
    while True:
        try:
            rank, ok, payload = results.get(timeout=0.2)
            got[rank] = (ok, payload)
        except queue.Empty:
            return


def _outcome(rank: int, got: tuple[bool, Any] | None, proc: Any, killed: bool) -> RankOutcome:
    code = proc.exitcode
    if got is None:
        return RankOutcome(rank, None, f"rank {rank} {_death(code, killed)} without returning a result", code)
    ok, payload = got
    return RankOutcome(rank, pickle.loads(payload) if ok else None, None if ok else str(payload), code)


def _death(code: int | None, killed: bool) -> str:
    """How a rank that returned nothing ended: killed by us at the deadline, a signal of its own, or an exit code.

    >>> _death(-6, killed=False)
    'died of SIGABRT'
    """
    if killed or code is None:
        return "did not finish before the deadline (killed)"
    if code < 0:  # a signal that we did not send: a C++ abort (gloo's checks), a crash, the OOM killer
        try:
            return f"died of {signal.Signals(-code).name}"
        except ValueError:
            return f"died of signal {-code}"
    return f"exited with code {code}"


def _last_line(text: str | None) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"
