"""The rank side of a local world: what each forked process runs before and after the worker function."""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def rank_main(rank: int, spec: tuple[Any, ...], blob: bytes, results: Any) -> None:
    """Run one rank: its own session, the parent's ``sys.path`` and environment, the group (when asked), ``fn``."""
    (module, qualname), world, port, backend, coll_s, start_s, sys_path, env, cwd = spec
    _own_session()
    try:
        os.chdir(cwd)  # the parent's folder now, not the one the fork server was started in
        _prepare(sys_path, env, world, port)
        fn = _resolve(module, qualname)
        args = pickle.loads(blob)
        if backend is not None:  # None: a lone process with no process group (launch_process)
            _join(rank, world, port, backend, coll_s, start_s)
        # pickled here, not by the queue's feeder thread, so that an unpicklable result is reported
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # report everything, SystemExit included: the parent names it
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()  # flush the result to the pipe before the hard exit below
    os._exit(0)


def _own_session() -> None:
    """A session of its own: the terminal's Ctrl-C goes to the parent alone, and the parent can end, with
    one signal to this session, whatever the worker started here (a child that keeps our output open)."""
    try:
        os.setsid()
    except OSError:  # already a session leader: nothing to do
        pass


def _prepare(sys_path: list[str], env: dict[str, str], world: int, port: int) -> None:
    sys.path[:] = sys_path + [p for p in sys.path if p not in sys_path]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if _has_interface("lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # read when the gloo group is created: loopback only
    os.environ.update(env)
    if hasattr(dist, "set_debug_level_from_env"):
        dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG is read at import: the server's, not ours
    # share the cores instead of oversubscribing them (each rank would start one thread per core)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _join(rank: int, world: int, port: int, backend: str, coll_s: float, start_s: float) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=start_s)
    )
    # Start-up (fork, imports) may be slow on a loaded machine: wait for every rank on the store, with the
    # long timeout; then create the group with the short one, which every later collective keeps. All
    # public API (no private timeout setter); the connect itself is fast once every rank is there.
    if store.add("gradagg/joined", 1) == world:
        store.set("gradagg/all-joined", "1")
    store.wait(["gradagg/all-joined"], datetime.timedelta(seconds=start_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=coll_s)
    )
    dist.barrier()


def _has_interface(name: str) -> bool:
    try:
        return any(n == name for _, n in socket.if_nameindex())
    except OSError:
        return False
