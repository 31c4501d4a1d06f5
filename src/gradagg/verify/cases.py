"""Every check of the two contracts: the case documents' 13, then ours, then fresh twins drawn per run.

The case documents' checks (:data:`OWNER_SUM_DOCUMENT`, 6, and :data:`MICROBATCH_MEAN_DOCUMENT`, 7)
are defined here only; the tests import them. Ours: seeded random cases against an independent
brute-force model, order independence, replica rows that never count, absent versus zero, an
all-absent microbatch that still counts in M, NaN as a value. Random cases use integer values so
that any correct implementation, whatever its summation order, matches exactly.

All of these are published (this module is importable by anyone), so an implementation that looks
its answers up here would pass them. :func:`fresh_cases` draws, from a seed the checker keeps, a twin
of every check with the same structure (the same replicas, late owners, absent values, all-absent
microbatch) and fresh ids and values, its expectation from the brute-force model: only an
implementation that computes can answer those.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

from gradagg.options import Contract

Case: TypeAlias = tuple[str, tuple[Any, ...], Any]  # (label, call arguments, expected)

SEED = 20261129  # fixed, so a failing observation can be replayed exactly
_DOC_ROWS = [["x", "a", "a", 1], ["x", "b", "a", 9], ["y", "c", "c", 2]]
OWNER_SUM_DOCUMENT: tuple[Case, ...] = (
    ("ignore replica copy", (_DOC_ROWS,), [["x", 1], ["y", 2]]),
    ("empty owners", ([],), []),
    ("only nonowner", ([["z", "b", "a", 1]],), []),
    ("owner can be late", ([["z", "b", "a", 1], ["z", "a", "a", 3]],), [["z", 3]]),
    ("several owners", ([["b", "b", "b", 1], ["a", "a", "a", 2]],), [["a", 2], ["b", 1]]),
    ("owner contributions add", ([["q", "q", "q", 1], ["q", "q", "q", 2]],), [["q", 3]]),
)
"""The owner-sum case document's 6 checks, verbatim (its scale factor N is 1)."""

MICROBATCH_MEAN_DOCUMENT: tuple[Case, ...] = (
    ("missing treated as zero", ([[2, None], [4, 6]], [1, 2]), [3, 3]),
    ("all present", ([[2, 4], [6, 8]], [2, 2]), [4, 6]),
    ("single missing", ([[None, 5]], [0, 1]), [0, 5]),
    ("empty rows", ([], []), []),
    ("zero active count", ([[0, None], [0, None]], [0, 0]), [0, 0]),
    ("late participation", ([[None, 2], [9, None], [3, 4]], [1, 1, 2]), [4, 2]),
    ("zero gradient", ([[0, None], [4, 2]], [1, 1]), [2, 1]),
)
"""The microbatch-mean case document's 7 checks, verbatim (its scale factor N is 1)."""


def cases(contract: Contract) -> list[Case]:
    """Every check of ``contract``: the case document's, then ours (the same list on every call).

    >>> [label for label, _, _ in cases("owner-sum")][:2]
    ['ignore replica copy', 'empty owners']
    """
    return owner_sum_cases() if contract == "owner-sum" else microbatch_mean_cases()


def fresh_cases(contract: Contract, seed: int) -> list[Case]:
    """A twin of every check of ``contract``: its structure, with ids and values drawn from ``seed``.

    Shard ids and worker ids are renamed one to one (kind kept: an int stays an int), gradients are
    multiplied by one nonzero integer, a microbatch mean's parameters are permuted; the expectation is
    the brute-force model's. The label names the original and the seed, so a failure can be replayed.

    >>> twin = fresh_cases("owner-sum", 7)[0]
    >>> twin[0]
    'ignore replica copy (fresh twin, seed 7)'
    >>> repr(fresh_cases("owner-sum", 7)) == repr(fresh_cases("owner-sum", 7))  # NaN != NaN: compare the text
    True
    """
    rng = random.Random(seed)
    twin = _owner_sum_twin if contract == "owner-sum" else _microbatch_mean_twin
    return [(f"{label} (fresh twin, seed {seed})", *twin(args, rng)) for label, args, _ in cases(contract)]


def _owner_sum_twin(args: tuple[Any, ...], rng: random.Random) -> tuple[tuple[Any, ...], Any]:
    (rows,) = args
    shard, worker, k = _renaming(rng), _renaming(rng), _factor(rng)
    twin = [[shard(s), worker(w), worker(o), _scaled(g, k)] for s, w, o, g in rows]
    return (twin,), _brute_owner_sum(twin)


def _microbatch_mean_twin(args: tuple[Any, ...], rng: random.Random) -> tuple[tuple[Any, ...], Any]:
    rows, counts = args
    width = len(rows[0]) if rows else 0
    order = rng.sample(range(width), width)
    k = _factor(rng)
    twin = [[_scaled(row[j], k) for j in order] for row in rows]
    twin_counts = [counts[j] for j in order] if counts is not None and len(counts) == width else counts
    return (twin, twin_counts), _brute_mean(twin)


def _renaming(rng: random.Random) -> Any:
    """A one-to-one renaming of ids that keeps each id's kind: ints to fresh ints, strings to fresh strings."""
    names: dict[Any, Any] = {}
    used: set[Any] = set()

    def rename(value: Any) -> Any:
        if value not in names:
            fresh = value
            while fresh in used or fresh == value:
                fresh = rng.randrange(10**6) if isinstance(value, int) else f"id{rng.getrandbits(40):x}"
            names[value] = fresh
            used.add(fresh)
        return names[value]

    return rename


def _factor(rng: random.Random) -> int:
    """A nonzero integer other than 1: a mutant wrong by any factor or any sum stays wrong."""
    return rng.choice([-7, -5, -3, -2, -1, 2, 3, 5, 7, 11])


def _scaled(value: Any, k: int) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_scaled(v, k) for v in value]
    return value * k


def _add(a: Any, b: Any) -> Any:
    return [x + y for x, y in zip(a, b, strict=True)] if isinstance(a, list) else a + b


# --- owner-sum ---------------------------------------------------------------


def owner_sum_cases() -> list[Case]:
    """The 6 case-document checks, then ours."""
    cases: list[Case] = [
        *OWNER_SUM_DOCUMENT,
        ("stale replica after owner", ([["s", "a", "a", 4], ["s", "b", "a", 7]],), [["s", 4]]),
        ("integer ids sort numerically", ([[10, 0, 0, 1], [9, 1, 1, 2]],), [[9, 2], [10, 1]]),
        ("vector gradients add element-wise",
         ([["v", 0, 0, [1, 2]], ["v", 1, 0, [9, 9]], ["v", 0, 0, [3, 4]]],), [["v", [4, 6]]]),
        ("large integers stay exact", ([["i", 0, 0, 2**60], ["i", 0, 0, 1]],), [["i", 2**60 + 1]]),
        ("nan in owner row propagates", ([["n", 0, 0, float("nan")]],), [["n", float("nan")]]),
        ("nan in replica row is not counted", ([["n", 1, 0, float("nan")], ["n", 0, 0, 5]],), [["n", 5]]),
    ]
    rng = random.Random(SEED)
    for k in range(4):
        rows = _random_owner_rows(rng)
        cases.append((f"random case {k} (seed {SEED}) against brute force", (rows,), _brute_owner_sum(rows)))
    cases.extend(_owner_sum_metamorphic(rng))
    return cases


def _random_owner_rows(rng: random.Random) -> list[list[Any]]:
    shards = [f"s{k}" for k in range(rng.randint(1, 8))]
    workers = list(range(4))
    owner_of = {s: rng.choice(workers) for s in shards}
    rows = []
    for _ in range(rng.randint(0, 40)):
        s = rng.choice(shards)
        rows.append([s, rng.choice(workers), owner_of[s], rng.randint(-1000, 1000)])
    return rows


def _brute_owner_sum(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """An independent formulation: for each shard with an owner row, add its owner rows (element-wise)."""
    result = []
    for s in sorted({r[0] for r in rows if r[1] == r[2]}):
        total: Any = None
        for r in rows:
            if r[0] == s and r[1] == r[2]:
                total = r[3] if total is None else _add(total, r[3])
        result.append([s, total])
    return result


def _owner_sum_metamorphic(rng: random.Random) -> Iterator[Case]:
    rows = _random_owner_rows(rng) + [["t", 0, 0, 11]]
    expected = _brute_owner_sum(rows)
    shuffled = rows[:]
    rng.shuffle(shuffled)
    yield ("any permutation gives the same result", (shuffled,), expected)
    stale = rows + [[r[0], "replica", r[2], 10**6] for r in rows]
    yield ("added non-owner rows never change the result", (stale,), expected)
    split = [["t", 0, 0, 5], ["t", 0, 0, 6]] + [r for r in rows if r[0] != "t"]
    yield ("an owner gradient split over two rows gives the same total", (split,), expected)


# --- microbatch mean ---------------------------------------------------------


def microbatch_mean_cases() -> list[Case]:
    """The 7 case-document checks, then ours."""
    cases: list[Case] = [
        *MICROBATCH_MEAN_DOCUMENT,
        ("absent and explicit zero give the same mean", ([[None, 3], [6, 3]], [1, 2]), [3, 3]),
        ("active counts are never the divisor", ([[2, None], [4, 6]], [100, 7]), [3, 3]),
        ("parameter absent everywhere has mean zero", ([[None, 1], [None, 3]], [1, 1]), [0, 2]),
        # M counts every microbatch run, also one in which no parameter received a gradient.
        ("an all-absent microbatch still counts in M", ([[2, 4], [None, None], [4, 2]], [2, 2]), [2, 2]),
        ("nan is a value, not absence", ([[float("nan"), None], [1, 1]], [2, 1]), [float("nan"), 0.5]),
    ]
    rng = random.Random(SEED + 1)
    for k in range(4):
        rows = _random_microbatches(rng)
        cases.append((f"random case {k} (seed {SEED + 1}) against brute force", (rows, None), _brute_mean(rows)))
    return cases


def _random_microbatches(rng: random.Random) -> list[list[Any]]:
    m, p = rng.randint(1, 9), rng.randint(1, 6)
    return [[None if rng.random() < 0.3 else rng.randint(-50, 50) for _ in range(p)] for _ in range(m)]


def _brute_mean(rows: Sequence[Sequence[Any]]) -> list[float]:
    """Column sums (absent as 0) over the counted number of microbatches."""
    m = len(rows)
    return [sum(0 if r[j] is None else r[j] for r in rows) / m for j in range(len(rows[0]))] if rows else []
