"""Before a pipelined step: every stage of the pipeline runs the same schedule, checked on every rank.

torch's schedules pair point-to-point sends and receives by microbatch: stages built with different
``n_microbatches`` (4 on one, 2 on the other), different schedule classes, or a stage count that does not
add up, wait in receives that never come, past any collective timeout. One ``all_gather_object`` over the
pipeline group before the step lets every rank see every rank's schedule and raise the same error.
"""

from __future__ import annotations

from typing import Any

from gradagg.errors import CollectiveError
from gradagg.torch.collectives import Group, all_gather_object, get_rank

_FIELDS = ("schedule", "n_microbatches", "num_stages")


def describe(schedule: Any, stages: list[Any]) -> dict[str, object]:
    """What must agree across the pipeline, and this rank's stage indices.

    ``n_microbatches`` is read from ``_n_microbatches``, private in torch 2.13 (no public accessor); a
    schedule without it is described as ``None`` there, and the other fields are still compared.
    """
    return {
        "schedule": type(schedule).__name__,
        "n_microbatches": getattr(schedule, "_n_microbatches", None),
        "num_stages": sorted({int(s.num_stages) for s in stages}),
        "stages": sorted(int(s.stage_index) for s in stages),
    }


def disagreement(tables: list[dict[str, object]]) -> str | None:
    """Why the gathered descriptions (one per pipeline rank) cannot run together; None when they can."""
    for field in _FIELDS:
        values = [t[field] for t in tables]
        if len({repr(v) for v in values}) > 1:
            first = next(r for r, v in enumerate(values) if repr(v) != repr(values[0]))
            return (f"{field} is {values[0]!r} on pipeline rank 0 and {values[first]!r} on pipeline rank {first} "
                    f"(per rank: {values})")
    num = tables[0]["num_stages"]
    held = sorted(i for t in tables for i in t["stages"])  # type: ignore[attr-defined]
    if not (isinstance(num, list) and len(num) == 1 and held == list(range(num[0]))):
        per_rank = [t["stages"] for t in tables]
        return f"the stages held per pipeline rank, {per_rank}, are not stages 0 to {num} - 1, each once"
    return None


def check_schedule(schedule: Any, stages: list[Any], group: Group) -> None:
    """Raise on every rank of ``group`` unless every rank runs the same schedule over one set of stages.

    Args:
        schedule: this rank's ``torch.distributed.pipelining`` schedule.
        stages: the stages this rank holds.
        group: the pipeline's process group.

    Raises:
        CollectiveError: on every rank, naming the field, both values and the pipeline ranks.
    """
    tables: list[dict[str, object]] = all_gather_object(describe(schedule, stages), group)  # type: ignore[assignment]
    problem = disagreement(tables)
    if problem is not None:
        raise CollectiveError(
            f"pipeline rank {get_rank(group)}: the stages of the pipeline disagree before the step: {problem}; "
            "build every stage's schedule with the same class and n_microbatches (replicas may differ), over "
            "stages 0..num_stages-1 each held once; nothing ran"
        )
