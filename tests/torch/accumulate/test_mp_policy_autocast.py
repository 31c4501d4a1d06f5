"""FSDP2's ``MixedPrecisionPolicy`` together with ``torch.autocast``, in both of the accumulator's forms
(``fsdp="shards"`` and ``"window"``), on 2 and 3 gloo ranks; and autocast alone (bf16; fp16 with a GradScaler) in
plain, DDP and FSDP2 loops on 3 ranks and under a clip that acts, which ``test_amp.py`` and ``test_amp_fsdp.py``
(2 ranks, a clip far above the norm) leave out. Workers in ``tests.torch.workers.mp_autocast``.

The policies: ``param_dtype`` bf16 with ``reduce_dtype`` float32 (torchtitan's), with ``reduce_dtype`` bf16, with
``output_dtype`` float32; ``param_dtype`` fp16 with a ``GradScaler`` and one window blown up on rank 1. Autocast
runs in the policy's ``param_dtype``. Uneven microbatch counts, a rank with none, a short last window; clipped (a
clip between the windows' norms) and not. Each window's gradient is compared with two things at the same
parameters: the float64 full-batch token mean (``error``), and the *floor*, each microbatch's low-precision
gradient summed exactly (``added``: what the accumulation adds, the part bounded by the dtypes; docs/contracts.md,
"Low precision").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradagg.testing import run_local_world
from tests.torch.accumulate.test_amp import BOUND, WORLD
from tests.torch.workers import mp_autocast as mp

CLIP = 0.45  # between the windows' true norms on 2 and on 3 ranks (asserted): some windows clipped, some not
Case = mp.Case
# autocast alone (float32 parameters, no policy): each layout in bf16 and in fp16 with a GradScaler, clipped
ALONE: list[Case] = [(layout, precision, CLIP, precision == "fp16") for layout in ("plain", "ddp", *mp.FSDP_FORMS)
                     for precision in ("bf16", "fp16")]
CASES: dict[int, list[Case]] = {
    2: [(form, policy, 0.0, policy.startswith("fp16")) for form in mp.FSDP_FORMS for policy in mp.POLICIES]
    + [("shards", "bf16, reduce fp32", CLIP, False), ("window", "bf16, reduce fp32", CLIP, False),
       ("plain", "fp16", CLIP, True), ("ddp", "bf16", CLIP, False)],
    3: [("shards", "bf16, reduce fp32", CLIP, False), ("window", "bf16, reduce fp32", CLIP, False),
        ("shards", "bf16, reduce bf16", 0.0, False), ("shards", "fp16, reduce fp32", 0.0, True), *ALONE],
}
# float32 sums of at most 12 microbatch gradients and one division, 2**-24 relative each: < 1e-6 (seen <= 1e-7)
ADDED_FP32 = 1e-5


def added_bound(case: Case, world: int) -> float:
    """What the accumulation may add, normwise, against the exactly summed microbatch gradients.

    The window form reduce-scatters gradagg's float32 buffer whatever ``reduce_dtype`` says, and so does the shards
    form with ``reduce_dtype`` float32: float32's round-off. The shards form with ``reduce_dtype`` bf16 lets FSDP
    reduce-scatter each microbatch in bf16: world - 1 additions, each rounded to bf16 (u = 2**-8) once; the window's
    sum over microbatches stays float32, so the bound does not grow with their number (seen 0.0008-0.0019).
    """
    form, policy = case[0], case[1]
    return (world - 1) * 2.0**-8 if form == "shards" and policy == "bf16, reduce bf16" else ADDED_FP32


def _precision(case: Case) -> str:
    return case[1][:4]


def _kind(case: Case) -> list[str]:
    """``.grad`` as each layout hands it out: a float32 DTensor shard under FSDP2, a float32 tensor otherwise."""
    return ["DTensor torch.float32" if case[0] in mp.FSDP_FORMS else "Tensor torch.float32"]


@pytest.fixture(scope="module")
def worlds() -> dict[int, dict[Case, list[list[dict[str, Any]]]]]:
    out = {}
    for world, cases in CASES.items():
        ranks = run_local_world(mp.mp_autocast_world, world, cases, **WORLD)
        out[world] = {case: [rank[i] for rank in ranks] for i, case in enumerate(cases)}
    return out


def _params() -> list[tuple[int, Case]]:
    return [(world, case) for world, cases in CASES.items() for case in cases]


def _id(value: object) -> str:
    return str(value) if isinstance(value, int) else "-".join(str(v).replace(" ", "").replace(",", "_") for v in value)


@pytest.mark.parametrize(("world", "case"), _params(), ids=_id)
def test_policy_and_autocast_are_the_token_mean_within_the_round_off(worlds: dict[int, Any], world: int,
                                                                     case: Case) -> None:
    """Every window (but the one that overflows under the scaler): a float32 ``.grad`` (a DTensor under FSDP2), D = the
    window's
    rows on every rank, a step taken, the same figures on every rank; what the accumulation adds within
    :func:`added_bound`; against the float64 token mean within autocast's bound (BOUND: 3e-2 bf16, 4e-3 fp16)
    wherever the floor itself is (one fp16 window of a single row whose output cancels, condition ~100, has a floor
    of 5.6e-3 on 2 ranks: no recipe can be closer; gradagg adds nothing to it); the usual weighting (a mean of
    per-rank means, in float64) off by far more than the bound."""
    ranks = worlds[world][case]
    assert all("raised" not in rank[0] for rank in ranks), ranks
    scaled, precision = case[3], _precision(case)
    for window, w in enumerate(ranks[0]):
        assert all(_same(w, rank[window]) for rank in ranks[1:]), (window, [rank[window] for rank in ranks])
        assert w["divisor"] == sum(len(x) for x in mp._batches(mp.COUNTS[world][window], window)), (window, w)
        if scaled and window == mp.OVERFLOW[0]:
            continue  # the next test
        assert w["finite"] and w["stepped"] and w["grad_kinds"] == _kind(case), (window, w)
        assert w["added"] <= added_bound(case, world), (window, w)
        assert w["error"] <= BOUND[precision] or w["floor"] > BOUND[precision], (window, w)
        assert w["naive"] > 5 * BOUND[precision], (window, w)


@pytest.mark.parametrize("world", list(CASES))
def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(worlds: dict[int, Any], world: int) -> None:
    """Under ``param_dtype`` fp16 with a GradScaler, rank 1's loss in window 2 is blown up past fp16's range: every
    rank sees a non-finite gradient, none steps, each halves its scale (no GradaggError); the windows around it
    are exact as in the test above."""
    for case in CASES[world]:
        if not case[3]:
            continue
        for rank in worlds[world][case]:
            blown = rank[mp.OVERFLOW[0]]
            assert not blown["finite"] and not blown["stepped"], blown
            assert blown["scale"] == rank[mp.OVERFLOW[0] - 1]["scale"] / 2, rank
            assert rank[mp.OVERFLOW[0] + 1]["finite"] and rank[mp.OVERFLOW[0] + 1]["stepped"], rank


@pytest.mark.parametrize("world", list(CASES))
def test_the_checks_see_the_clip_and_a_low_precision_sum(worlds: dict[int, Any], world: int) -> None:
    """The clipped cases clip some windows and not others (CLIP lies between the true norms), so a gradient scaled
    wrongly cannot hide behind a clip that always acts; and summing the same microbatch gradients in the compute
    dtype (a running bf16 or fp16 sum) adds more than float32's bound, so ``added`` would catch it."""
    for case in CASES[world]:
        runs = worlds[world][case][0]
        if case[2]:
            norms = [w["norm"] for w in runs]
            assert min(norms) < CLIP < max(norms), norms
        if case[2] or case[1] == "bf16, reduce fp32":
            assert max(w["lossy_added"] for w in runs) > 10 * ADDED_FP32, runs


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same figures on two ranks (NaN equal to NaN: the window that overflowed)."""
    return all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)


def test_a_bf16_reduce_in_the_shards_form_is_warned_at_construction() -> None:
    """Only the shards form with a policy that reduces in bf16 warns (one PrecisionWarning naming the dtype, the
    ranks and both settings that keep float32's round-off, at the caller's line); the window form, and a float32
    reduce, do not."""
    ranks = run_local_world(mp.warned_world, 2, **WORLD)
    for got in ranks:
        warned = {case: msgs for case, msgs in got.items() if msgs}
        assert list(warned) == ["shards: bf16, reduce bf16"], got
        (msg,) = warned["shards: bf16, reduce bf16"]
        assert msg.startswith("mp_autocast.py: fsdp='shards'"), msg
        assert "torch.bfloat16" in msg and "over the 2 ranks" in msg, msg
        assert "reduce_dtype=torch.float32" in msg and "fsdp='window'" in msg, msg


def test_the_reduce_dtype_is_read_where_torch_keeps_it_and_none_elsewhere() -> None:
    """The private path (``_get_fsdp_state()._mp_policy``) with its fallback: a module without it gives None (no
    warning), param_dtype stands in for an unset reduce_dtype, a float32 reduce is not low."""
    from types import SimpleNamespace

    from gradagg.torch.accumulate.wrappers.fsdp import reduce_dtype

    def module(**policy: Any) -> Any:
        state = SimpleNamespace(_mp_policy=SimpleNamespace(**{"reduce_dtype": None, "param_dtype": None, **policy}))
        return SimpleNamespace(_get_fsdp_state=lambda: state)

    assert reduce_dtype([object()]) is None
    assert reduce_dtype([module()]) is None
    assert reduce_dtype([module(param_dtype=torch.bfloat16)]) is torch.bfloat16
    assert reduce_dtype([module(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)]) is None
    assert reduce_dtype([module(), module(reduce_dtype=torch.float16)]) is torch.float16
