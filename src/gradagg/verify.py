"""The contract checks, reported as observations in the case documents' form.

:func:`run_checks` runs every check of one contract against an implementation
(the built-in one by default, or any function a user names) and returns
``{"observations": [{"check", "actual", "expected", "passed"}, ...], "passed": bool}``.

The checks are the case documents' 13 (6 owner-sum, 7 microbatch-mean) plus
our own: seeded random cases against an independent brute-force model, order
independence, replica rows that never count, absent versus zero, NaN as a
value. Random cases use integer values so that any correct implementation,
whatever its summation order, matches exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeAlias

from gradagg.reference import microbatch_mean, owner_sum

Contract: TypeAlias = Literal["owner-sum", "microbatch-mean"]
CONTRACTS: tuple[Contract, ...] = ("owner-sum", "microbatch-mean")
Case: TypeAlias = tuple[str, tuple[Any, ...], Any]  # (label, call arguments, expected)

SEED = 20261129  # fixed, so a failing observation can be replayed exactly
N = 1  # the case documents' scale factor


def run_checks(contract: Contract, impl: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Run every check of ``contract`` against ``impl`` (default: the built-in one).

    Args:
        contract: ``"owner-sum"`` or ``"microbatch-mean"``.
        impl: a function with the contract's signature: ``f(rows)`` for
            owner-sum, ``f(rows, active_counts)`` for microbatch-mean.

    Returns:
        ``{"observations": [...], "passed": bool}``. An implementation that
        raises fails that check; the exception is recorded as its ``actual``.

    >>> run_checks("owner-sum")["passed"]
    True
    """
    if impl is None:
        impl = owner_sum if contract == "owner-sum" else microbatch_mean
    cases = owner_sum_cases() if contract == "owner-sum" else microbatch_mean_cases()
    observations = [_observe(label, impl, args, expected) for label, args, expected in cases]
    return {"observations": observations, "passed": all(o["passed"] for o in observations)}


def _observe(label: str, impl: Callable[..., Any], args: tuple[Any, ...], expected: Any) -> dict[str, Any]:
    try:
        actual = impl(*args)
    except Exception as exc:  # a user's implementation may fail in any way; that is a failed check
        return {"check": label, "actual": f"raised {type(exc).__name__}: {exc}", "expected": _json(expected),
                "passed": False}
    return {"check": label, "actual": _json(actual), "expected": _json(expected), "passed": _same(actual, expected)}


def _same(actual: Any, expected: Any) -> bool:
    """Equality where NaN equals NaN (NaN must propagate, so it is an expected value)."""
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(actual, float) and math.isnan(actual)
    if isinstance(expected, list):
        return isinstance(actual, (list, tuple)) and len(actual) == len(expected) and all(
            _same(a, e) for a, e in zip(actual, expected)
        )
    return bool(actual == expected) and type(actual) is not bool


def _json(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become strings (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


# --- owner-sum ---------------------------------------------------------------


def owner_sum_cases() -> list[Case]:
    """The 6 case-document checks, then ours."""
    rows0 = [["x", "a", "a", N], ["x", "b", "a", 9 * N], ["y", "c", "c", 2 * N]]
    cases: list[Case] = [
        ("ignore replica copy", (rows0,), [["x", N], ["y", 2 * N]]),
        ("empty owners", ([],), []),
        ("only nonowner", ([["z", "b", "a", N]],), []),
        ("owner can be late", ([["z", "b", "a", N], ["z", "a", "a", 3 * N]],), [["z", 3 * N]]),
        ("several owners", ([["b", "b", "b", N], ["a", "a", "a", 2 * N]],), [["a", 2 * N], ["b", N]]),
        ("owner contributions add", ([["q", "q", "q", N], ["q", "q", "q", 2 * N]],), [["q", 3 * N]]),
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
    """An independent formulation: for each shard with an owner row, add its owner rows."""
    owned = sorted({r[0] for r in rows if r[1] == r[2]})
    return [[s, sum(r[3] for r in rows if r[0] == s and r[1] == r[2])] for s in owned]


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
        ("missing treated as zero", ([[2 * N, None], [4 * N, 6 * N]], [1, 2]), [3 * N, 3 * N]),
        ("all present", ([[2 * N, 4 * N], [6 * N, 8 * N]], [2, 2]), [4 * N, 6 * N]),
        ("single missing", ([[None, 5 * N]], [0, 1]), [0, 5 * N]),
        ("empty rows", ([], []), []),
        ("zero active count", ([[0, None], [0, None]], [0, 0]), [0, 0]),
        ("late participation", ([[None, 2 * N], [9 * N, None], [3 * N, 4 * N]], [1, 1, 2]), [4 * N, 2 * N]),
        ("zero gradient", ([[0, None], [4 * N, 2 * N]], [1, 1]), [2 * N, N]),
        ("absent and explicit zero give the same mean", ([[None, 3], [6, 3]], [1, 2]), [3, 3]),
        ("active counts are never the divisor", ([[2, None], [4, 6]], [100, 7]), [3, 3]),
        ("parameter absent everywhere has mean zero", ([[None, 1], [None, 3]], [1, 1]), [0, 2]),
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
    return [sum(0 if r[j] is None else r[j] for r in rows) / m for j in range(len(rows[0]))]
