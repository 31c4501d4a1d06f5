"""Running the checks in this process, and judging answers against the expected values.

:func:`observations` is the one judge: the isolated runner (:mod:`gradagg.verify.isolate`) gets its
answers from a child process and judges them here, in the parent.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

from gradagg.options import Contract
from gradagg.reference import microbatch_mean, owner_sum
from gradagg.verify.cases import Case, cases, fresh_cases
from gradagg.verify.child import plain


def run_checks(contract: Contract, impl: Callable[..., Any] | None = None, *,
               fresh_seed: int | None = None) -> dict[str, Any]:
    """Run every check of ``contract`` against ``impl`` (default: the built-in one), in this process.

    Args:
        contract: ``"owner-sum"`` or ``"microbatch-mean"``.
        impl: a function with the contract's signature: ``f(rows)`` for
            owner-sum, ``f(rows, active_counts)`` for microbatch-mean. Each
            call gets its own copy of the arguments.
        fresh_seed: also run a fresh twin of every check drawn from this seed
            (:func:`gradagg.verify.cases.fresh_cases`), e.g. to replay an isolated run.

    Returns:
        ``{"observations": [...], "passed": bool}``. An implementation that
        raises (``SystemExit`` included) fails that check; the exception is
        recorded as its ``actual``.

    >>> run_checks("owner-sum")["passed"]
    True
    """
    if impl is None:
        impl = owner_sum if contract == "owner-sum" else microbatch_mean
    checks = all_checks(contract, fresh_seed)
    return observations(checks, [call(impl, args) for _, args, _ in checks])


def all_checks(contract: Contract, fresh_seed: int | None) -> list[Case]:
    """The published checks of ``contract``, then, with a seed, a fresh twin of each."""
    return cases(contract) + ([] if fresh_seed is None else fresh_cases(contract, fresh_seed))


def call(impl: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """``(True, plain result)`` of ``impl(*args)`` on a copy of ``args``, or ``(False, "raised ...")``.

    >>> call(len, (["a", "b"],))
    (True, 2)
    """
    try:
        return True, plain(impl(*copy.deepcopy(args)))
    except (Exception, SystemExit) as exc:  # a user's function may fail in any way; that is a failed check
        return False, f"raised {type(exc).__name__}: {exc}"


def observations(checks: Sequence[Case], answers: Sequence[tuple[bool, Any]]) -> dict[str, Any]:
    """Judge ``answers`` (one :func:`call` result per check, in order) against the checks' expected values.

    >>> checks = cases("microbatch-mean")
    >>> observations(checks, [call(microbatch_mean, args) for _, args, _ in checks])["passed"]
    True
    """
    result = []
    for (label, _, expected), (ok, value) in zip(checks, answers, strict=True):
        actual = _json(value) if ok else value
        result.append({"check": label, "actual": actual, "expected": _json(expected),
                       "passed": ok and same(value, expected)})
    return {"observations": result, "passed": all(o["passed"] for o in result)}


def same(actual: Any, expected: Any) -> bool:
    """Equality of plain values where NaN equals NaN (NaN must propagate, so it is an expected value).

    >>> same([1, float("nan")], [1.0, float("nan")]), same(True, 1)
    (True, False)
    """
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(actual, float) and math.isnan(actual)
    if isinstance(expected, list):
        return isinstance(actual, list) and len(actual) == len(expected) and all(
            same(a, e) for a, e in zip(actual, expected)
        )
    if isinstance(expected, str):
        return type(actual) is str and actual == expected
    return type(actual) in (int, float) and actual == expected


def _json(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become strings (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, list):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return value.get("unrepresentable", repr(value))
    return value
