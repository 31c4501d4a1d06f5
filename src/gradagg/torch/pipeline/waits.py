"""A pipelined step's point-to-point waits, bounded by the collective timeout.

torch's schedules wait for their sends and receives with ``Work.wait()``, no timeout given: gloo then bounds the
wait by the pipeline group's own timeout, and ``dist.new_group`` gives a group torch's default (30 minutes), not
the default group's. A stage whose forward raised, in a process that lives on (a loop that caught the error), would
leave its peer stages in their receives that long. Inside :func:`bounded` each of the schedule's waits is
``Work.wait(timeout)`` (public) with the collective timeout: the default group's, or the pipeline group's where that
is shorter (a bound never lengthens a wait). A peer then raises within it, and :meth:`PipelineAccumulator.step`
turns that into a WindowError (:func:`.failures.schedule_failure`).

Not bounded here: the first step's shape inference (blocking ``send_object_list`` / ``recv_object_list`` inside
``PipelineStage``), bounded by the pipeline group's own timeout only.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from gradagg.torch.collectives import Group, device_for


def group_timeout(group: Group = None) -> datetime.timedelta | None:
    """The timeout ``group`` (None: the default group) was made with; None where it cannot be read.

    >>> group_timeout() is None  # no process group in a doctest
    True
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = group if group is not None else dist.group.WORLD
        # private: torch has no public getter of a group's timeout; its backend's options hold it. Where this
        # breaks (another torch), None: the waits keep the group's own timeout (tests/torch/test_pipeline_trust.py)
        timeout = pg._get_backend(device_for(group)).options._timeout  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - any failure to read it means the same: not known
        return None
    return timeout if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0 else None


def step_timeout(*groups: Group) -> datetime.timedelta | None:
    """The bound of a step's waits: the shortest of the default group's and ``groups``' timeouts (None: none known)."""
    known = [t for t in (group_timeout(g) for g in (None, *groups)) if t is not None]
    return min(known) if known else None


@contextmanager
def bounded(timeout: datetime.timedelta | None) -> Iterator[None]:
    """Inside the block, every wait of torch's pipeline schedules is ``Work.wait(timeout)``.

    Args:
        timeout: the bound; None leaves the waits as torch has them.

    The schedules wait through one module function, ``torch.distributed.pipelining.schedules._wait_batch_p2p``
    (private; swapped for the block and put back after it). Where it is absent (another torch), the block runs
    with torch's own waits.
    """
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_wait_batch_p2p", None)
    if timeout is None or original is None:
        yield
        return

    def wait(work: list[dist.Work]) -> None:  # torch's own signature
        for w in work:
            w.wait(timeout)

    schedules._wait_batch_p2p = wait
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


__all__ = ["bounded", "group_timeout", "step_timeout"]
