"""The default FSDP2 form (``fsdp="shards"``): sharded gradients only, any microbatch counts, gradagg pads.

The ranks agree on each round; a rank that ran out runs a padding microbatch (the last forward replayed, or
``pad=fn``) whose gradients are dropped, so FSDP's all-gathers and reduce-scatters pair on every rank (gloo
aborts on a mismatch) and the result is the full-batch gradient. Workers: ``tests.torch.workers.fsdp_uneven``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradagg.testing import run_local_world
from tests.torch.workers import fsdp as fw
from tests.torch.workers import fsdp_uneven as fu
from tests.torch.workers.train import VALID  # valid tokens of global microbatch k (k % 10)

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0}
# float64 throughout: the same per-token terms summed in another order (per microbatch, per rank, then across
# ranks) differ from one backward of the whole batch by a few ulps of 1e-16; seen <= 2e-16.
TOL64 = 1e-13


def _error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def _tokens(n: int) -> int:
    return sum(VALID[k % len(VALID)] for k in range(n))


@pytest.fixture(scope="module")
def fuzz() -> list[list[dict[str, Any]]]:
    return run_local_world(fu.fuzz_world, 3, 4, 3, **WORLD)


def test_random_uneven_counts_give_the_full_batch_gradient(fuzz: list[list[dict[str, Any]]]) -> None:
    """Seeded random counts 0..4 on 3 ranks (seed fu.SEED), 4 windows per loop style (microbatches(), bare calls,
    the forward before the with, pad=fn): D = the valid tokens of all sum(counts) microbatches, M = sum(counts),
    the gradients those of the float64 one-process full batch and of PureAccumulator, the same on every rank;
    every rank ran max(counts) rounds, real or padding (which is how FSDP's collectives paired)."""
    for rank in fuzz:
        for k, run in enumerate(rank):
            counts, n = run["counts"], sum(run["counts"])
            where = (fu.SEED, k, run["style"], counts)
            assert run["divisor"] == _tokens(n) and run["m"] == n, where
            assert run["rounds"] == max(counts), where
            assert _error(run["grads"], fw.truth64(n)) <= TOL64, where
            assert _error(run["grads"], run["pure"]) <= TOL64, where
            assert all(torch.equal(run["grads"][p], fuzz[0][k]["grads"][p]) for p in run["grads"]), where
    assert any(0 in run["counts"] for run in fuzz[0]) and any(len(set(r["counts"])) > 1 for r in fuzz[0])


def test_fuzz_tolerance_catches_the_known_wrong_divisors(fuzz: list[list[dict[str, Any]]]) -> None:
    """The tolerance resolves the wrong fixes: dividing by the padded count of microbatches' tokens (padding
    counted as real, a copy of microbatch 0 per padding round), or averaging the ranks' own token means."""
    caught = 0
    for run in fuzz[0]:
        counts, n = run["counts"], sum(run["counts"])
        pads = sum(max(counts) - c for c in counts)
        if pads:
            truth = fw.truth64(n)
            padded_d = {p: g * _tokens(n) / (_tokens(n) + pads * VALID[0]) for p, g in truth.items()}
            assert _error(padded_d, truth) > 100 * TOL64
            caught += 1
    assert caught


def test_pad_none_refuses_uneven_counts_on_every_rank() -> None:
    """pad=None: counts (2, 2) run (D = 6 + 2 + 5 + 0 = 13); counts (1, 3) raise GradaggError on both ranks,
    with microbatches() and with bare calls, naming pad= and the ranks, with every gradient None (the window
    dropped); the next even window runs again (D = 13)."""
    for r in run_local_world(fu.refusal_world, 2, **WORLD):
        assert r["even"] == 13 and r["after"] == 13, r
        for style in ("microbatches", "bare"):
            kind, message, dropped = r[style]
            assert kind == "GradaggError" and "pad=None" in message and "rank(s) [0]" in message, message
            assert dropped, style


@pytest.mark.parametrize("counts", [[1, 4, 0, 3], [0, 0, 2, 0]])
def test_hsdp_uneven_counts_pad_themselves(counts: list[int]) -> None:
    """HSDP on mesh (2, 2), counts (1, 4, 0, 3) and (0, 0, 2, 0), look-ahead and bare calls, the head in FSDP or
    plain beside it: the float64 full batch, D = the valid tokens; each rank padded max(counts) - its count."""
    for rank, r in enumerate(run_local_world(fu.hsdp_world, 4, counts, **WORLD)):
        for key, got in r.items():
            assert got["divisor"] == _tokens(sum(counts)), key
            assert got["padded"] == max(counts) - counts[rank], key
            assert _error(got["grads"], fw.truth64(sum(counts))) <= TOL64, key


@pytest.mark.parametrize("mode", ["shards", "window"])
def test_torchtitan_full_dtensor_backend(mode: str) -> None:
    """fully_shard with dp_mesh_dims (torchtitan's full_dtensor: the unsharded parameters are Replicate() DTensors,
    the inputs Shard(0) DTensors), counts (0, 3): the float64 full batch, D = 13, gradients Shard(0) DTensors."""
    for r in run_local_world(fu.full_dtensor_world, 2, [0, 3], mode, **WORLD):
        assert r["divisor"] == 13 and r["kinds"] == ["DTensor (Shard(dim=0),)"], r["kinds"]
        assert _error(r["grads"], fw.truth64(3)) <= TOL64
