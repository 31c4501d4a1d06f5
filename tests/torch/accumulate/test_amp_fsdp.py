"""``torch.autocast`` bf16 and fp16 with a GradScaler inside an FSDP2 loop (``fully_shard``), both of the
accumulator's forms (``fsdp="shards"`` and ``"window"``), on 2 gloo ranks: the loop, data and bounds of
``test_amp.py`` (uneven microbatches, a rank with none in window 0, one window overflowing on rank 1), with
FSDP2's float32 DTensor parameters; workers in ``tests.torch.workers.amp_fsdp``. One world per form runs every
case.
"""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.accumulate.test_amp import BOUND, WORLD
from tests.torch.workers import amp, amp_fsdp

MODES = ("shards", "window")
Case = tuple[str, bool, str, str, str]  # precision, scaled, the scaler (torch's or FSDP's sharded), overflow, attached
# attached: "" (finish() called), "microbatches" (attach(opt), acc.microbatches()) or "loop" (attach(opt), a plain for
# loop: a rank with no microbatch calls nothing of the accumulator before its unscale_)
EXACT: list[Case] = [("bf16", False, "torch", "whole", ""), ("fp16", True, "torch", "whole", ""),
                     ("fp16", True, "torch", "whole", "microbatches"), ("fp16", True, "sharded", "whole", "loop")]
# an overflow whose non-finite elements land in rank 0's shard alone (rank 1's is finite), under torch's GradScaler
# and FSDP's ShardedGradScaler
SHARD: list[Case] = [("fp16", True, "torch", "shard", ""), ("fp16", True, "sharded", "shard", "")]
CASES = {mode: EXACT + SHARD for mode in MODES}


@pytest.fixture(scope="module")
def worlds() -> dict[str, dict[Case, list[list[dict[str, Any]]]]]:
    out = {}
    for mode in MODES:
        ranks = run_local_world(amp_fsdp.amp_fsdp_world, 2, mode, CASES[mode], **WORLD)
        out[mode] = {case: [ranks[0][i], ranks[1][i]] for i, case in enumerate(CASES[mode])}
    return out


@pytest.mark.parametrize(("mode", "case"), [(m, c) for m in MODES for c in CASES[m] if c in EXACT],
                         ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_autocast_and_grad_scaler_under_fsdp2_are_exact_within_the_round_off(worlds: dict[str, Any], mode: str,
                                                                             case: Case) -> None:
    """Every window the float64 full batch within autocast's round-off (BOUND, as without FSDP), the usual recipe
    (a mean of per-rank means) off by its weighting; with a scaler, the window rank 1 blew up is skipped on every
    rank and the scale halved there, the next window exact again; rank 1 in window 0 ran no microbatch, yet its
    scaler unscales the window's gradient. Attached (torch's GradScaler and FSDP's ShardedGradScaler), no
    ``finish()`` is called: ``unscale_`` finishes the window first, in both forms, with ``acc.microbatches()`` or a
    plain loop. With the plain loop rank 1's ``unscale_`` in window 0 is its first call of the accumulator while
    rank 0 waits in the window's opening collective (FSDP2's unshard; the shards form's rounds): it used to ask the
    ranks first and abort gloo on the mismatched sizes."""
    precision, scaled = case[0], case[1]
    for rank in worlds[mode][case]:
        assert "raised" not in rank[0], rank
        for window, w in enumerate(rank):
            if scaled and window == amp.OVERFLOW[0]:
                assert not w["finite"] and not w["stepped"], (window, w)
                assert w["scale"] == rank[window - 1]["scale"] / 2, (window, w)
                continue
            assert w["finite"] and w["stepped"], (window, w)
            assert w["error"] <= BOUND[precision] and w["naive"] > 5 * BOUND[precision], (window, w)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scaler", ["torch", "sharded"])
def test_a_non_finite_shard_on_one_rank_skips_the_step_on_every_rank(worlds: dict[str, Any], mode: str,
                                                                     scaler: str) -> None:
    """Rank 1's backward in window 2 is infinite in hidden units 0-7 only: after the reduce-scatter rank 0's shard is
    non-finite and rank 1's finite, yet neither rank steps and both halve the scale (torch's GradScaler through
    DTensor's dispatch, ShardedGradScaler by its all-reduce); the windows before and after are exact."""
    ranks = worlds[mode][("fp16", True, scaler, "shard", "")]
    assert all("raised" not in rank[0] for rank in ranks), ranks
    blown = [rank[amp.OVERFLOW[0]] for rank in ranks]
    assert [w["mine_finite"] for w in blown] == [False, True], blown
    for rank in ranks:
        for window, w in enumerate(rank):
            if window == amp.OVERFLOW[0]:
                assert not w["stepped"] and w["scale"] == rank[window - 1]["scale"] / 2, (window, w)
            else:
                assert w["finite"] and w["stepped"] and w["error"] <= BOUND["fp16"], (window, w)
