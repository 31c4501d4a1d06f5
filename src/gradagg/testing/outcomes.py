"""How each rank of a local world ended: collected from the results queue until the deadline, then named."""

from __future__ import annotations

import pickle
import queue
import signal
import time
from dataclasses import dataclass
from typing import Any

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


def collect(results: Any, procs: list[Any], deadline: float) -> tuple[dict[int, tuple[bool, Any]], set[int]]:
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


def outcome(rank: int, got: tuple[bool, Any] | None, proc: Any, killed: bool) -> RankOutcome:
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


