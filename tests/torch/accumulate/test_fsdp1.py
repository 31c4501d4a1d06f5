"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) under the accumulator (:mod:`.wrappers.fsdp1`).

2 gloo ranks, FSDP1 on the CPU (``device_id=cpu``), float64 models against the one-process float64 full batch;
workers in ``tests.torch.workers.fsdp1``. Before: every FSDP1 model was refused at construction (and earlier still,
use_orig_params=True met a misleading comparison of its per-rank pieces, use_orig_params=False was accepted and
averaged by FSDP1 every microbatch).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from gradagg.testing import run_local_world
from tests.torch.workers import fsdp1

WORLD: dict[str, Any] = {"collective_timeout_s": 10.0, "timeout_s": 180.0}
# float64 throughout: the sums of a few microbatches in another order than the full batch's one matmul
EXACT = 1e-12


@pytest.fixture(scope="module")
def exact() -> list[dict[tuple[Any, ...], Any]]:
    return run_local_world(fsdp1.exact_world, 2, **WORLD)


@pytest.mark.parametrize("config", fsdp1.CONFIGS, ids=[" ".join(map(str, c)) for c in fsdp1.CONFIGS])
def test_fsdp1_windows_are_the_token_mean_of_the_full_batch(
    exact: list[dict[tuple[Any, ...], Any]], config: tuple[str, bool, str]
) -> None:
    """FULL_SHARD and SHARD_GRAD_OP, use_orig_params True and False, one unit or nested ones: uneven counts with
    look-ahead (3/5), a rank with none (0/4 with bare microbatch() calls: it pads in finish()), a short last
    window (2/0), even ones; each the float64 token mean of exactly its microbatches, D the window's tokens."""
    for rank in exact:
        for counts, _look in fsdp1.WINDOWS:
            got = rank[(*config, str(counts))]
            assert got["error"] <= EXACT, (config, counts, got)
            assert got["divisor"] == _tokens(counts), (config, counts, got)
    assert exact[0][(*config, "[3, 5]")]["padded"] == 2  # rank 0 ran out after 3: two padding rounds


def _tokens(counts: list[int]) -> float:
    """The valid tokens of the window's microbatches (the windows take the global microbatches in turn)."""
    from tests.torch.workers import train as tw

    start = 0
    for c, _ in fsdp1.WINDOWS if len(counts) == 2 else fsdp1.WINDOWS_4:
        if c == counts:
            break
        start += sum(c)
    return float(sum(tw.VALID[k % len(tw.VALID)] for k in range(start, start + sum(counts))))


@pytest.fixture(scope="module")
def exact_4() -> list[dict[tuple[Any, ...], Any]]:
    configs = [("FULL_SHARD", True, "nested"), ("SHARD_GRAD_OP", False, "root"), *fsdp1.HYBRID_CONFIGS]
    return run_local_world(fsdp1.exact_world, 4, configs, **WORLD)


def test_fsdp1_on_4_ranks(exact_4: list[dict[tuple[Any, ...], Any]]) -> None:
    """4 ranks: two with none in one window, three with none in the next (they pad), even counts; the ranks hold
    pieces of different sizes (use_orig_params=True: some empty). With them HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on
    2 replicas x 2 shards: FSDP1's own average over the 4 ranks, divided by D / 4 at finish() (float64: a division
    more than the hook's path, still round-off), padding by a zero loss."""
    for rank in exact_4:
        for key, got in rank.items():
            if key[-1] == "after close":
                assert got <= EXACT, key
                continue
            assert got["error"] <= EXACT and got["divisor"] == _tokens(json.loads(key[-1])), (key, got)


@pytest.mark.parametrize("config", fsdp1.CONFIGS, ids=[" ".join(map(str, c)) for c in fsdp1.CONFIGS])
def test_after_close_fsdp1_averages_again(
    exact: list[dict[tuple[Any, ...], Any]], config: tuple[str, bool, str]
) -> None:
    """FSDP1 cannot remove a communication hook: once the accumulator is closed, gradagg's averages over the
    ranks, as FSDP1's own does (float64: one division by the world in another place than FSDP1's)."""
    assert exact[0][(*config, "after close")] <= EXACT


@pytest.mark.parametrize("world", sorted(fsdp1.MIXED))
def test_fsdp1_mixed_precision_is_within_bf16_round_off_and_its_own_recipe_is_not(world: int) -> None:
    """MixedPrecision(param_dtype=bf16) on float32 parameters, reduced in float32 or in bf16: FULL_SHARD on 2 ranks
    (counts 3/5), HYBRID_SHARD on 2 replicas x 2 shards (counts 3/0/5/1: a rank with none pads by a zero loss, FSDP1
    averaging over the 4 ranks, finish() dividing by D / 4). Within 2 eps(bf16) of the float64 full batch, relative
    to the largest entry (the forward and backward run in bf16, each microbatch's weight gradient rounded once to
    bf16, <= eps/2 relative; the window's sum in float32). FSDP1's own recipe (a mean loss per microbatch, FSDP1
    averaging each reduce; even counts, as it needs) is off by far more: a mean of microbatch means, not the token
    mean."""
    tol = 2 * torch.finfo(torch.bfloat16).eps
    for rank in run_local_world(fsdp1.mixed_precision_world, world, **WORLD):
        assert rank["torch.float32"] <= tol, rank
        assert rank["torch.bfloat16"] <= tol, rank
        assert rank["fsdp1 own"] > 10 * tol, rank


REFUSALS = {
    "window": "fsdp='window' is not built for FSDP1",
    "terms": "terms= under FSDP1: FSDP1 cannot back-propagate twice through one forward",
    "no shard": "uses NO_SHARD",
    "hybrid beside full": "beside units of another kind (hybrid or NO_SHARD, and not)",
    "plain head": "parameter '2.weight' is in no FSDP1 unit (2 such)",
    "bf16": "is torch.bfloat16: FSDP1 sums the window's microbatches into .grad",
    "own hook": "FSDP1 refused gradagg's communication hook",
    "named": "(FSDP1), which the accumulator was not given",
}


@pytest.mark.parametrize("how", list(REFUSALS))
def test_what_fsdp1_cannot_do_exactly_is_refused_on_every_rank_naming_what_works(how: str) -> None:
    """At construction, one GradaggError on every rank, naming the setting and what works instead."""
    for said in run_local_world(fsdp1.refusal_world, 2, how, **WORLD):
        assert said.startswith("GradaggError: ") and REFUSALS[how] in said, said


def test_terms_divided_ahead_are_exact_under_fsdp1_where_terms_counted_as_they_run_cannot_be() -> None:
    """What the terms= refusal names instead: ``acc.divisors()`` (two terms, the valid tokens and the microbatches,
    counted ahead; one backward of their sum) on uneven counts 3/5 with look-ahead and 0/4 with bare microbatch()
    calls, FULL_SHARD nested with the original parameters and SHARD_GRAD_OP flat: the float64 full batch's
    token mean + microbatch mean (1e-12: float64 sums in another order). And the refusal's reason, on this torch:
    FSDP1 itself fails a second backward through one forward (it freed the gathered parameters after the first)."""
    for rank in run_local_world(fsdp1.terms_world, 2, **WORLD):
        for key, got in rank["windows"].items():
            assert got["error"] <= EXACT and got["divisors"] == got["want"], (key, got)
        assert "out of bounds for storage of size 0" in rank["second backward"], rank["second backward"]


def test_a_plain_fsdp1_model_is_accepted() -> None:
    assert run_local_world(fsdp1.refusal_world, 2, "accepted", **WORLD) == ["accepted", "accepted"]


def test_fsdp1s_own_clip_inside_a_window_finishes_it_when_attached_and_is_refused_otherwise() -> None:
    """Before: ``model.clip_grad_norm_`` (FSDP1's method, not torch.nn.utils') clipped the undivided partial sums
    FSDP1 holds in .grad inside a window, silently. Now refused on every rank without attach(); with it, the window
    finishes first and the clip sees the exact gradient (a float32 model, FSDP1's clip takes no float64: its norm
    within 1e-5 relative of the float64 truth's, float32 round-off over a few microbatches)."""
    for rank in run_local_world(fsdp1.clip_world, 2, **WORLD):
        assert str(rank[False]).startswith("WindowError: FullyShardedDataParallel.clip_grad_norm_ called"), rank
        assert abs(rank[True] - rank["want"]) <= 1e-5 * rank["want"], rank
