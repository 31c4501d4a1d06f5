"""The known wrong fixes, kept so the checks can prove they catch them.

Each mutant has the signature of the contract it gets wrong and is what people
actually write (the case documents' "failure" and "unsuccessful fix", and the
near miss that forgets a microbatch in which nothing was present). Defined
here once; :mod:`gradagg.verify`'s tests, the engine and training tests and the
demo use these.
``gradagg verify --impl gradagg.mutants:sum_every_replica`` must exit 1 for
every one of them; the test suite holds that.
"""

from __future__ import annotations

from collections.abc import Sequence


def sum_every_replica(rows: Sequence[Sequence[object]]) -> list[list[object]]:
    """Owner-sum that counts every replica: double-counts replicated shards."""
    totals: dict[object, object] = {}
    for shard, _worker, _owner, gradient in rows:
        totals[shard] = totals.get(shard, 0) + gradient  # type: ignore[operator]
    return [[s, totals[s]] for s in sorted(totals)]  # type: ignore[type-var]


def first_replica(rows: Sequence[Sequence[object]]) -> list[list[object]]:
    """Owner-sum that keeps the first row seen per shard: may keep a stale non-owner."""
    kept: dict[object, object] = {}
    for shard, _worker, _owner, gradient in rows:
        kept.setdefault(shard, gradient)
    return [[s, kept[s]] for s in sorted(kept)]  # type: ignore[type-var]


def divide_by_active_counts(
    rows: Sequence[Sequence[object]], active_counts: Sequence[int] | None = None
) -> list[float]:
    """Microbatch mean divided by the summed activity counters instead of M."""
    if not rows:
        return []
    divisor = max(1, sum(active_counts or []))
    return [sum((0 if row[j] is None else row[j]) for row in rows) / divisor for j in range(len(rows[0]))]  # type: ignore[misc]


def divide_by_participation(
    rows: Sequence[Sequence[object]], active_counts: Sequence[int] | None = None
) -> list[float]:
    """Microbatch mean divided by each parameter's participation count instead of M."""
    if not rows:
        return []
    width = len(rows[0])
    sums = [sum(row[j] for row in rows if row[j] is not None) for j in range(width)]  # type: ignore[misc]
    present = [sum(row[j] is not None for row in rows) for j in range(width)]
    return [s / max(1, n) for s, n in zip(sums, present)]


def divide_by_nonempty_microbatches(
    rows: Sequence[Sequence[object]], active_counts: Sequence[int] | None = None
) -> list[float]:
    """Microbatch mean divided by the microbatches with at least one present value instead of M.

    Right until a microbatch runs in which no parameter received a gradient: that
    microbatch still counts in M.
    """
    if not rows:
        return []
    divisor = max(1, sum(any(v is not None for v in row) for row in rows))
    return [sum((0 if row[j] is None else row[j]) for row in rows) / divisor for j in range(len(rows[0]))]  # type: ignore[misc]


OWNER_SUM_MUTANTS = {"sum_every_replica": sum_every_replica, "first_replica": first_replica}
MICROBATCH_MEAN_MUTANTS = {
    "divide_by_active_counts": divide_by_active_counts,
    "divide_by_participation": divide_by_participation,
    "divide_by_nonempty_microbatches": divide_by_nonempty_microbatches,
}
