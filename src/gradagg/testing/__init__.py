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
* **every rank in a session of its own**, killed with the world: whatever a
  rank starts (a child that keeps our output open) ends with it, and a
  terminal's Ctrl-C reaches the parent alone (the server is started deaf to
  it, and the ranks are all started before an interrupt is taken).
* **the main guard is checked first** (:mod:`gradagg.testing.guard`): each
  rank imports the parent's script again, so a call at its top level would
  start a world in every rank; it is refused with one :class:`GradaggError`.

:func:`launch_process` runs one function the same way, with no process group:
code that must not run in the caller's process, under a deadline.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from gradagg.errors import CollectiveError, last_line
from gradagg.testing.guard import check_main_guard, reference
from gradagg.testing.outcomes import RankOutcome, collect, outcome
from gradagg.testing.rank import rank_main
from gradagg.testing.server import also_preload, context, ctrl_c_deferred, end_sessions


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
    ctx = context(preload)
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
    return _run_processes(context(preload), spec, pickle.dumps(args), 1, timeout_s)[0]


def _run_processes(ctx: Any, spec: tuple[Any, ...], blob: bytes, n: int, timeout_s: float) -> list[RankOutcome]:
    """Start ``n`` ranks, collect their results until the deadline, then end their sessions, whatever happened."""
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(rank, spec, blob, results), daemon=True) for rank in range(n)]
    try:
        with ctrl_c_deferred():
            for p in procs:
                p.start()
        got, killed = collect(results, procs, time.monotonic() + timeout_s)
        return [outcome(rank, got.get(rank), procs[rank], rank in killed) for rank in range(n)]
    finally:
        end_sessions(procs)


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
        heads = "; ".join(f"rank {o.rank}: {last_line(o.error)}" for o in failed)
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


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


__all__ = ["RankOutcome", "also_preload", "launch_local_world", "launch_process", "launched_by_torchrun",
           "run_local_world", "run_world"]
