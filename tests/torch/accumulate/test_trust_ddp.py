"""DDP's own settings kept, and the accumulator's group checked, on 3 gloo ranks (issue 22).

Before the fixes: DDP on a subgroup with the accumulator on the default group averaged over DDP's groups; a
parameter in DDP's ``parameters_to_ignore`` was averaged anyway; a buffer changed on one rank was broadcast blindly
(gloo aborted the process, or the buffers differed silently); a DTensor weight failed in ``finish()`` with a raw
``.tolist()`` error; an accumulator on a group without this rank ran alone, silently.

Workers in ``tests.torch.workers.ddp_trust``. Every gradient is a sum of small integers (the microbatch
coefficients times 1, 2 or 3) divided once by a count: float64 holds the sum exactly and the quotient is the one
rounding of the exact mean, so the tolerance is 1e-12 relative.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import ddp_trust as wt

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 180.0, "preload": ["torch._dynamo"]}
TOL = 1e-12
FUZZ_SEED = 2207  # the trials' seeds are drawn from it (printed by the test on failure)
TRIALS = 24


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    seeds = [random.Random(FUZZ_SEED).randrange(10**6) + t for t in range(TRIALS)]
    out = run_local_world(wt.trust_world, 3, **WORLD)
    fuzz = run_local_world(wt.fuzz_world, 3, seeds, **WORLD)
    for rank, r in enumerate(out):
        r["fuzz"] = list(zip(seeds, fuzz[rank]))
    return out


def _coefs(rank: int, n: int) -> list[float]:
    return [wt.coef(rank, k) for k in range(n)]


def _close(got: list[float] | None, want: float) -> bool:
    return got is not None and all(math.isclose(g, want, rel_tol=TOL) for g in got)


def test_ddp_on_a_subgroup_reduces_over_its_group(results: list[dict[str, Any]]) -> None:
    """DDP over ranks {0, 1} and {2}, the accumulator given no group (or DDP's own): ranks 0 and 1 hold the mean
    over their 5 microbatches, rank 2 its own (it was the mean over all 6 on every rank)."""
    pair = sum(_coefs(0, wt.COUNTS[0]) + _coefs(1, wt.COUNTS[1])) / (wt.COUNTS[0] + wt.COUNTS[1])
    alone = sum(_coefs(2, wt.COUNTS[2])) / wt.COUNTS[2]
    for rank, r in enumerate(results):
        want = pair if rank < 2 else alone
        for case in ("subgroup", "same_group_given"):
            assert all(_close(g, want) for g in r[case].values()), (rank, case, r[case], want)


def test_another_group_than_ddps_is_refused_on_every_rank(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        kind, message = r["subgroup_mismatch"]
        ddp_ranks = "[0, 1]" if rank < 2 else "[2]"
        assert kind == "GradaggError" and "global ranks [0, 1, 2]" in message, (rank, message)
        assert f"process_group, global ranks {ddp_ranks}" in message and "group=None" in message, (rank, message)


@pytest.mark.parametrize("case", ["ignored", "ignored_weighted"])
def test_ddps_ignored_parameter_stays_rank_local(results: list[dict[str, Any]], case: str) -> None:
    """``b`` in DDP's parameters_to_ignore: each rank's own sum over its own count (its M, or its total weight
    1 + 2 + ... + m); ``a`` the global mean. The ledger names ``b`` as rank-local with its divisor."""
    weighted = case == "ignored_weighted"
    count = (lambda n: n * (n + 1) / 2) if weighted else (lambda n: float(n))
    total = sum(sum(_coefs(r, n)) for r, n in enumerate(wt.COUNTS)) / sum(count(n) for n in wt.COUNTS)
    for rank, r in enumerate(results):
        got = r[case]
        own = sum(_coefs(rank, wt.COUNTS[rank])) / count(wt.COUNTS[rank])
        assert _close(got["grads"]["a"], total) and _close(got["grads"]["b"], own), (rank, got["grads"], total, own)
        assert got["rank_local"] == ["b"]
        assert "rank-local, not reduced (DDP's parameters_to_ignore)" in got["report"], got["report"]
        assert f"own count {int(count(wt.COUNTS[rank]))}: b" in got["report"], got["report"]


def test_a_rank_local_count_its_dtype_cannot_divide_by_is_refused_on_every_rank(results: list[dict[str, Any]]) -> None:
    """Rank 0's own total weight (2e-39) below float32's smallest normal: its rank-local ``b`` cannot be divided by it
    (inf), so every rank refuses, naming rank 0, in counting.divisor_problem's words, before anything is handed out."""
    for rank, r in enumerate(results):
        assert isinstance(r["ignored_tiny"], tuple), (rank, r["ignored_tiny"])
        kind, message = r["ignored_tiny"]
        assert kind == "WindowError" and "rank 0" in message, (rank, message)
        if rank == 0:
            assert "is below the smallest normal float32" in message and "parameters_to_ignore" in message, message


def test_a_rank_whose_own_weights_are_all_zero_has_no_rank_local_gradient(results: list[dict[str, Any]]) -> None:
    """Rank 1's microbatches all weigh 0: its ignored ``b`` has nothing to be divided by, so it is absent (None, not
    its sum divided by 1); ``a`` is the global mean over the total weight (1 + 2 on rank 0, 1 on rank 2)."""
    weights = [[k + 1 for k in range(n)] if r != 1 else [0] * n for r, n in enumerate(wt.COUNTS)]
    total = sum(sum(_coefs(r, n)) for r, n in enumerate(wt.COUNTS)) / sum(map(sum, weights))
    for rank, r in enumerate(results):
        got = r["ignored_zero"]
        assert _close(got["grads"]["a"], total), (rank, got["grads"], total)
        if rank == 1:
            assert got["grads"]["b"] is None and got["divisor"] is None, got
            assert "divided by this rank's own count -: b" in got["report"], got["report"]
        else:
            own = sum(_coefs(rank, wt.COUNTS[rank])) / sum(weights[rank])
            assert _close(got["grads"]["b"], own) and got["divisor"] == sum(weights[rank]), (rank, got, own)


@pytest.mark.parametrize(("case", "mine", "theirs"), [
    ("buffer_dtype", "float64 of shape (2,)", "float32 of shape (2,)"),
    ("buffer_shape", "float64 of shape (2,)", "float64 of shape (3,)"),
])
def test_a_buffer_changed_on_one_rank_is_refused_on_every_rank(
    results: list[dict[str, Any]], case: str, mine: str, theirs: str
) -> None:
    """Named with the ranks and both descriptions, on every rank; finish() keeps refusing until discard(); then,
    the buffer put back, the next window is exact (the mean over all 6 microbatches)."""
    total = sum(sum(_coefs(r, n)) for r, n in enumerate(wt.COUNTS)) / sum(wt.COUNTS)
    for rank, r in enumerate(results):
        got = r[case]
        kind, message = got["error"]
        assert kind == "CollectiveError", (rank, got)
        assert f"buffer 'seen' is {mine} on rank 0 but {theirs} on rank 1" in message, (rank, message)
        assert got["again"] is not None and "discard()" in got["again"][1], (rank, got["again"])
        assert all(_close(g, total) for g in got["after"].values()), (rank, got["after"])


def test_an_accumulator_on_a_group_without_this_rank_is_refused(results: list[dict[str, Any]]) -> None:
    assert [r["outside_group"] for r in results[:2]] == [None, None]
    kind, message = results[2]["outside_group"]
    assert kind == "GradaggError" and "global rank 2 is not in the process group" in message, message


def test_dtensor_weights(results: list[dict[str, Any]]) -> None:
    """A replicated DTensor counts its value (2 per rank, D = 6; gradient (1 + 2 + 3) / 6 = 1); a partial one is
    refused at microbatch() on every rank, naming its placements."""
    for r in results:
        assert r["dtensor_replicate"]["divisor"] == 6.0 and _close(r["dtensor_replicate"]["grad"], 1.0)
        kind, message = r["dtensor_partial"]
        assert kind == "GradaggError" and "Partial" in message and "Replicate()" in message, message


def test_holding_ddp_warns_nothing(results: list[dict[str, Any]]) -> None:
    """Building the accumulator over DDP (its buffer sync turned off through the public attribute), a window and
    close(), with warnings as errors (issue 25: no deprecated DDP option of gradagg's own)."""
    assert [r["no_warnings"] for r in results] == [None] * 3


# --- the class ----------------------------------------------------------------------------------------------------


def expected(pl: dict[str, Any], rank: int) -> Any:
    """The float64 truth of one trial on ``rank``: its gradients, or the error class and a fragment of its message."""
    part = next(p for p in pl["parts"] if rank in p)
    if pl["group"] == "world" and len(part) < 3:
        return ("GradaggError", "reduces over its process_group")
    change = pl["change"]
    if change is not None and change[1] in part and len(part) > 1:
        return ("CollectiveError", "buffer 'seen'")
    weight = (lambda r: sum(pl["weights"][r])) if pl["weighted"] else (lambda r: pl["counts"][r])
    if sum(pl["counts"][r] for r in part) == 0:
        return ("WindowError", "M = 0")
    if sum(weight(r) for r in part) == 0:
        return ("WindowError", "total weight of the window is 0")
    grads: dict[str, float | None] = {}
    for j, name in enumerate(wt.SHAPES):
        ranks = [rank] if name in pl["ignored"] else part
        terms = [(j + 1) * wt.coef(r, k) for r in ranks for k in range(pl["counts"][r])
                 if name != "c" or pl["uses_c"][r][k]]
        divisor = sum(weight(r) for r in ranks)
        grads[name] = None if not terms or divisor == 0 else math.fsum(terms) / divisor
    return grads


def reach(plans: list[dict[str, Any]]) -> Counter[str]:
    """How many (trial, rank) pairs drew each class the fuzz test checks (the partitions counted per trial)."""
    drawn = Counter[str]()
    for pl in plans:
        drawn[f"partition {pl['parts']}"] += 1
        drawn.update(c for c, hit in [("ignored and weighted", pl["ignored"] and pl["weighted"]),
                                      ("a buffer changed", pl["change"] is not None)] if hit)
        for rank in range(3):
            want = expected(pl, rank)
            drawn["grads" if isinstance(want, dict) else want[0]] += 1
            if not isinstance(want, dict):
                continue
            # an ignored parameter this rank has gradients for: divided by its own count, or absent where that is 0
            held = [n for n in pl["ignored"] if pl["counts"][rank] and (n != "c" or any(pl["uses_c"][rank]))]
            if held and pl["weighted"]:
                zero = sum(pl["weights"][rank]) == 0
                drawn["a rank-local divisor of 0 (absent)" if zero else "a rank-local divisor > 0"] += 1
            if want["c"] is None:
                drawn["c absent"] += 1
    return drawn


REACHED = [f"partition {p}" for p in wt.PARTITIONS] + [
    "ignored and weighted", "a buffer changed", "grads", "GradaggError", "CollectiveError", "WindowError",
    "a rank-local divisor of 0 (absent)", "a rank-local divisor > 0", "c absent",
]


def test_ddp_groups_ignored_parameters_and_buffers_fuzzed(results: list[dict[str, Any]]) -> None:
    """Seeded trials (FUZZ_SEED): DDP's groups drawn from every partition of 3 ranks, 0-2 ignored parameters,
    0-3 microbatches per rank (weighted or not, weights 0-3 or all 0 on one rank, ``c`` reached or not), the
    accumulator given no group, DDP's or the default one, a buffer's dtype or shape changed on one rank or not: on
    every rank the exact gradients (shared ones over DDP's group, ignored ones rank-local, absent ones None) or the
    expected error. The draws must reach every class in REACHED (a rank-local divisor of 0 among them)."""
    plans = [wt.plan(seed) for seed, _ in results[0]["fuzz"]]
    drawn = reach(plans)
    assert all(drawn[c] > 0 for c in REACHED), drawn  # the draws reach every class checked below
    checked = 0
    for rank, r in enumerate(results):
        for seed, got in r["fuzz"]:
            want = expected(wt.plan(seed), rank)
            where = (FUZZ_SEED, seed, rank, wt.plan(seed), got)
            if isinstance(want, tuple):
                assert isinstance(got, tuple) and got[0] == want[0] and want[1] in got[1], where
                continue
            assert isinstance(got, dict), where
            for name, value in want.items():
                assert (got[name] is None) if value is None else _close(got[name], value), (name, value, where)
            checked += 1
    assert checked >= TRIALS, checked  # most trials end in gradients on most ranks, not errors
