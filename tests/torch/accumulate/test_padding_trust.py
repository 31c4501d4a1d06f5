"""The shards form's padding against a hostile user (issue 22): padding counts nowhere, and fails loudly.

Workers: tests.torch.workers.padding_trust. A padding microbatch (``pad="replay"`` or ``pad=fn``) runs a
forward and a backward only so that FSDP2's collectives pair; it must leave every buffer of the model as it
found it (counters, BatchNorm's statistics, buffers the forward reassigns), and one rank's failure inside it
must be one GradaggError on every rank, within the collective timeout.
"""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import padding_trust as pt

TIMEOUT = 5.0  # the world's collective timeout, seconds
WORLD: dict[str, Any] = {"collective_timeout_s": TIMEOUT, "timeout_s": 180.0}
# float64: BatchNorm's statistics and the gradients are the truth's terms in another order (FSDP's all-gathered
# parameters are the same values; the sums over ranks and microbatches are reordered): a few ulps; seen < 1e-15.
TOL64 = 1e-12


@pytest.fixture(scope="module", params=[2, 3])
def padded(request: pytest.FixtureRequest) -> list[list[dict[str, Any]]]:
    return run_local_world(pt.buffers_world, request.param, 3, **WORLD)


def test_padding_leaves_every_buffer_as_it_found_it(padded: list[list[dict[str, Any]]]) -> None:
    """Seeded uneven counts (seed pt.SEED), 3 windows per style (microbatches(), bare calls, pad=fn) on 2 and 3
    ranks: each rank's buffers (an in-place counter, a reassigned counter, BatchNorm's running statistics and
    num_batches_tracked, a reassigned non-persistent buffer) are those of a plain replica that ran only that
    rank's real microbatches, and the gradients (which read the reassigned counter) are the truth's."""
    ran_padding = 0
    for rank in padded:
        for run in rank:
            where = (pt.SEED, run["style"], run["window"], run["counts"])
            assert run["buffers"].keys() == run["want_buffers"].keys(), where
            for name, want in run["want_buffers"].items():
                got = run["buffers"][name]
                assert got.dtype == want.dtype and got.shape == want.shape, (where, name)
                assert float((got.double() - want.double()).abs().max()) <= TOL64, (where, name, got, want)
            assert run["grad_error"] <= TOL64, (where, run["grad_error"])
            ran_padding += run["padded"]
    assert ran_padding > 0  # the seeds did make ranks pad



REASONS = {  # words the error must carry on every rank, besides the failing rank
    "non-scalar loss": "tensor of shape (6, 1)", "raises before the model": "no padding batch today",
    "raises after the forward": "KeyError", "returns a float": "returned float",
    "loss without a gradient": "requires_grad=False", "part of the model": "'blocks.0'",
    "unpicklable replay": "cannot be sent",
}


@pytest.mark.parametrize("style", ["microbatches", "bare"])
def test_one_rank_padding_failure_is_one_error_on_every_rank(style: str) -> None:
    """Rank 0's padding fails (pad=fn returns a non-scalar loss, a float or a loss without a gradient; raises
    before or after the model's forward; runs only a block of the model; pad='replay' must borrow inputs with a
    lambda keyword argument): a GradaggError on both ranks within the collective timeout (not a raw error, not
    a wait), naming the failing rank and what went wrong, the window dropped (every gradient None); the next even window
    runs (D = 6 + 2 + 5 + 0 = 13)."""
    cases = [(how, style) for how in pt.FAILURES]
    ranks = run_local_world(pt.failure_world, 2, cases, **WORLD)
    for case in cases:
        for rank, r in enumerate(ranks):
            assert r[case]["error"] is not None, (case, rank)
            kind, message, seconds = r[case]["error"]
            assert kind in ("GradaggError", "CollectiveError", "WindowError"), (case, rank, message)
            failing = 1 if case[0] == "unpicklable replay" else 0  # there the source rank's inputs fail
            assert f"rank {failing}" in message and REASONS[case[0]] in message, (case, rank, message)
            assert seconds < TIMEOUT + 5, (case, rank, seconds)
            assert r[case]["dropped"] and r[case]["after"] == 13, (case, rank, r[case])


@pytest.mark.parametrize("style", ["microbatches", "bare"])
def test_padding_failure_nothing_can_complete_is_named_on_every_rank(style: str) -> None:
    """Rank 0 runs no microbatch and its pad fn raises before the model: no stand-in (no inputs of its own).
    Rank 0 raises GradaggError at once, naming itself and the reason; rank 1, left in FSDP's all-gather, a
    CollectiveError naming rank 0 as the padding rank within the collective timeout (not a raw gloo error)."""
    ranks = run_local_world(pt.unrecoverable_world, 2, style, **WORLD)
    (kind0, message0, _), (kind1, message1, seconds1) = ranks  # type: ignore[misc]
    assert kind0 == "GradaggError" and "rank 0" in message0 and "no padding batch today" in message0, message0
    assert "nothing can complete" in message0
    assert kind1 == "CollectiveError" and "rank(s) [0] ran a padding microbatch" in message1, message1
    assert seconds1 < TIMEOUT + 5
