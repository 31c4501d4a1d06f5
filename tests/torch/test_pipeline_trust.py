"""PipelineAccumulator against a hostile user (issue 22), on 2 gloo ranks: one pipeline of 2 stages.

Workers: tests.torch.workers.pipeline_trust. Counts given in reused tensors; schedules that disagree between
stages; a stage's loss function raising on one microbatch: each exact, or one GradaggError on every rank
within the collective timeout.
"""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import pipeline as pw
from tests.torch.workers import pipeline_trust as pt

TIMEOUT = 5.0  # the world's collective timeout, seconds
WORLD: dict[str, Any] = {"collective_timeout_s": TIMEOUT, "timeout_s": 180.0}
# float64: the oracle's per-token terms summed in another order (per microbatch, per tie), divided by the same
# D: a few ulps of the largest gradient (as tests/torch/test_pipeline.py).
EXACT = 1e-14


@pytest.fixture(scope="module")
def reused() -> list[dict[Any, Any]]:
    return run_local_world(pt.reused_world, 2, **WORLD)


@pytest.mark.parametrize("kind", list(pw.SCHEDULES))
@pytest.mark.parametrize("dtype", list(pt.REUSED))
def test_count_in_a_reused_tensor_is_taken_when_given(reused: list[dict[Any, Any]], kind: str, dtype: str) -> None:
    """The loss returns its count in one tensor overwritten for every microbatch (each dtype, a view, shape
    (1,)): each microbatch counts its own value (6, 4, 10, 3), D = 23 (not 4 x the last count, 12), exact."""
    for r in reused:
        got = r[(kind, dtype)]
        assert got["divisor"] == 23.0, got
        assert got["error"] <= EXACT, got
    assert reused[1][(kind, dtype)]["local"] == (6.0, 4.0, 10.0, 3.0)


MISMATCHES = [(kind, "n_microbatches") for kind in pw.SCHEDULES] + [("gpipe", "schedule"), ("1f1b", "schedule")]


def _quick_and_named(out: tuple[str, str, float] | None, *words: str) -> None:
    assert out is not None, "the step did not raise"
    kind, message, seconds = out
    assert kind in ("CollectiveError", "WindowError"), out
    assert all(w in message for w in words), (words, message)
    assert seconds < TIMEOUT + 5, out


@pytest.mark.parametrize("case", MISMATCHES, ids=lambda c: "-".join(c))
def test_stages_that_disagree_are_refused_before_the_step(case: tuple[str, str]) -> None:
    """Rank 0's schedule has 4 microbatches and rank 1's 2 (each schedule), or the two ranks run different
    schedule classes: a CollectiveError on both ranks before any point-to-point receive, naming the field,
    both values and the ranks (not a wait in torch's receives past every timeout)."""
    kind, what = case
    values = {"n_microbatches": ("4", "2"), "schedule": ()}[what]
    for r in run_local_world(pt.mismatch_world, 2, [case], **WORLD):
        _quick_and_named(r[case], what, "pipeline rank 0", "pipeline rank 1", *values)


@pytest.mark.parametrize("kind", list(pw.SCHEDULES))
def test_one_stage_loss_failure_is_one_error_on_every_rank(kind: str) -> None:
    """The last stage's loss function fails on microbatch 2 of 4 (raises; returns a non-scalar loss, a
    non-scalar count, a loss without a gradient, or no pair): WindowError on both ranks, quickly, naming the
    microbatch, the rank and what went wrong, every gradient None; the next step on the same stages is exact."""
    cases = [(kind, how) for how in pt.FAILURES]
    ranks = run_local_world(pt.failure_world, 2, cases, **WORLD)
    for case in cases:
        for r in ranks:
            got = r[case]
            _quick_and_named(got["failed"], "microbatch 2", "pipeline rank 1", "loss function")
            assert got["all_none"], case
            assert got["after"] <= EXACT, (case, got["after"])
        assert "no such label" in ranks[0][(kind, "raises")]["failed"][1]


def test_schedule_description_without_the_private_count() -> None:
    """The count of microbatches comes from torch's private ``_n_microbatches``: a schedule without it is still
    compared on its class and stages (the fallback); stages held twice or missing are refused."""
    from types import SimpleNamespace

    from gradagg.torch.pipeline.agreement import describe, disagreement

    def stage(i: int, n: int = 2) -> SimpleNamespace:
        return SimpleNamespace(stage_index=i, num_stages=n)

    bare = [describe(SimpleNamespace(), [stage(0)]), describe(SimpleNamespace(), [stage(1)])]
    assert bare[0]["n_microbatches"] is None and disagreement(bare) is None
    twice = [describe(object(), [stage(0)]), describe(object(), [stage(0)])]
    assert "[[0], [0]]" in str(disagreement(twice))
    counted = SimpleNamespace(_n_microbatches=4)
    assert str(disagreement([describe(counted, [stage(0)]), bare[1]])).startswith(
        "n_microbatches is 4 on pipeline rank 0 and None on pipeline rank 1")
    assert "num_stages" in str(disagreement([describe(object(), [stage(0)]), describe(object(), [stage(1, 3)])]))


@pytest.fixture(scope="module", params=list(pw.SCHEDULES))
def forward_failures(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, run_local_world(pt.forward_failures_world, 2, request.param, **WORLD)


def test_stage_forward_failure_is_a_gradagg_error_on_every_rank(forward_failures: tuple[str, list[Any]]) -> None:
    """Stage 0's module raises on microbatch 2 (no stand-in can replace a stage's forward): rank 0 raises
    WindowError naming the cause; rank 1, whose receive breaks once rank 0's process has ended, a WindowError
    too (not a raw gloo error), both quickly, every gradient None."""
    _, ranks = forward_failures
    for r in (rank["ends"] for rank in ranks):
        assert r["failed"] is not None and r["failed"][0] == "WindowError", r
        assert r["failed"][2] < TIMEOUT + 5 and r["all_none"], r
    assert "caused by ValueError: bad token ids" in ranks[0]["ends"]["failed"][1]
    assert "peer stage failed or left" in ranks[1]["ends"]["failed"][1]


def test_stage_failure_in_a_process_that_lives_on_does_not_leave_its_peer_waiting(
        forward_failures: tuple[str, list[Any]]) -> None:
    """Stage 0's module raises on microbatch 2 and rank 0 lives on (it waits for rank 1 in a barrier of a group
    with a long timeout): rank 1, in a receive from rank 0 over a pipeline group made by ``new_group`` without a
    timeout (torch's default, 30 minutes), raises a WindowError of its own once the collective timeout bounds its
    wait (gloo names it); every gradient None on both ranks. Without the bound the world misses its deadline."""
    kind, ranks = forward_failures
    for r in (rank["lives_on"] for rank in ranks):
        assert r["failed"] is not None and r["failed"][0] == "WindowError", (kind, r)
        assert r["all_none"], (kind, r)
    assert "caused by ValueError: bad token ids" in ranks[0]["lives_on"]["failed"][1]
    assert f"{int(TIMEOUT * 1000)}ms" in ranks[1]["lives_on"]["failed"][1], (kind, ranks[1])


def test_the_bound_is_the_shorter_timeout_and_unreadable_ones_fall_back(
        forward_failures: tuple[str, list[Any]]) -> None:
    """The bound of a step's waits is the default group's timeout (the world's, 5 s) where the pipeline group has
    torch's default (30 minutes); a group whose timeout cannot be read (torch's private getter gone) gives None."""
    import datetime

    _, ranks = forward_failures
    for r in ranks:
        got = r["timeouts"]
        assert got["world"] == got["step"] == datetime.timedelta(seconds=TIMEOUT), got
        assert got["pipeline"] == datetime.timedelta(minutes=30) and got["unreadable"] is None, got


def test_bounded_leaves_torch_waits_where_it_cannot_bound_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """No timeout known, or a torch without the schedules' wait function: the block runs with torch's own waits;
    with one, the schedules wait with it inside the block and torch's function is back after it, even on error."""
    import datetime

    from torch.distributed.pipelining import schedules

    from gradagg.torch.pipeline.waits import bounded

    original = schedules._wait_batch_p2p
    with bounded(None):
        assert schedules._wait_batch_p2p is original
    waited: list[object] = []

    class Work:
        def wait(self, timeout: object = None) -> None:
            waited.append(timeout)

    with pytest.raises(KeyError), bounded(datetime.timedelta(seconds=3)):
        schedules._wait_batch_p2p([Work(), Work()])
        raise KeyError("a failing step")
    assert waited == [datetime.timedelta(seconds=3)] * 2 and schedules._wait_batch_p2p is original
    monkeypatch.delattr(schedules, "_wait_batch_p2p")
    with bounded(datetime.timedelta(seconds=3)):
        assert not hasattr(schedules, "_wait_batch_p2p")
