"""DDP with its default buffer broadcast, kept by the accumulator: every window starts with rank 0's buffers.

Workers in ``tests.torch.workers.ddp_buffers``: 3 gloo ranks, buffers that diverge per rank (a running mean
added to the input, a BatchNorm's running statistics and its int64 counter), uneven counts with a rank
running no microbatch in three of the four windows (rank 0 in the first), against the float64 one-process truth.
"""

from __future__ import annotations

from typing import Any

import torch

from gradagg.testing import run_local_world
from tests.torch.workers import ddp_buffers as wb

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}
WINDOWS = [[0, 2, 3], [2, 0, 1], [1, 3, 0], [2, 2, 2]]
# float64: the same per-microbatch gradients summed in another order (per rank, then over ranks) and divided
# by the same M: each of <= 7 additions of terms below 10 rounds by 2**-53 relative, far below 1e-12.
TOL = 1e-12


def test_default_ddp_buffers_broadcast_once_per_window() -> None:
    """Gradients exact against the truth in every window; after every finish() each rank holds exactly rank 0's
    buffers; DDP's own forward sync is off while the accumulator holds it and back on after close()."""
    results = run_local_world(wb.broadcast_world, 3, WINDOWS, **WORLD)
    for rank, r in enumerate(results):
        assert max(r["errors"]) < TOL, (rank, r["errors"])
        assert r["buffers_equal"] == [True] * len(WINDOWS), (rank, r["buffers_equal"])
        assert r["sync"] == [True, False, True], (rank, r["sync"])


def test_the_buffers_matter() -> None:
    """The check has teeth: with each rank's own buffers carried over (no broadcast), the later windows'
    gradients differ from the truth by far more than the tolerance."""
    want, unsynced = wb.truth(WINDOWS), wb.truth(WINDOWS, broadcast=False)
    first = want[0]["grads"]  # the first window starts from the same buffers either way (DDP's init sync)
    assert all(torch.equal(g, unsynced[0]["grads"][n]) for n, g in first.items())
    diffs = [max(float((a["grads"][n] - b["grads"][n]).abs().max()) for n in a["grads"])
             for a, b in zip(want[1:], unsynced[1:])]
    assert min(diffs) > 1e-3, diffs


def test_a_buffer_ddp_ignores_stays_each_ranks_own() -> None:
    """A buffer in DDP's parameters_to_ignore is not broadcast by finish() (DDP would not): each rank keeps its own,
    the ranks' differ; the other buffers are rank 0's on every rank."""
    results = run_local_world(wb.ignored_buffer_world, 2, **WORLD)
    assert [r["own"] for r in results] == [True, True], results
    assert not torch.equal(results[0]["shift"], results[1]["shift"])
    assert torch.equal(results[0]["running_mean"], results[1]["running_mean"])
