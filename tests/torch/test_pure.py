"""The fast accumulator against its slow, obviously right twin (:mod:`gradagg.torch.pure`), on 2 gloo ranks.

Plain, DDP (also with gradient_as_bucket_view and find_unused_parameters) and FSDP2 models; counts (0, 4),
(3, 5) and (1, 0); D = M or the token total. Both sum the same per-microbatch float64 gradients over the
same ranks, in another order (buckets and flat buffer against one all_reduce per parameter): each of the <=
8 additions rounds by at most 2**-53 relative, |gradients| < 10, so TOL = 1e-12 is far above what order can
change and far below any counting mistake (>= 1e-2 here).
"""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.pure import PureAccumulator
from tests.torch.workers import dist as w
from tests.torch.workers import twins

TOL = 1e-12
WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}


@pytest.fixture(scope="module")
def twins_results() -> dict[tuple[str, bool, str], Any]:
    results = run_local_world(twins.twins_world, 2, **WORLD)
    assert results[0].keys() == results[1].keys()
    return results[0] | {(k[0], k[1], k[2] + " rank 1"): v for k, v in results[1].items()}


@pytest.mark.parametrize("form", twins.FORMS)
@pytest.mark.parametrize("counts", [str(c) for c in twins.COUNTS])
@pytest.mark.parametrize("weighted", [False, True])
def test_fast_equals_its_twin(twins_results: dict[tuple[str, bool, str], Any], form: str, counts: str,
                              weighted: bool) -> None:
    """Same gradients (<= TOL) on both ranks, None exactly where the twin has None (``unused`` everywhere)."""
    if (counts, weighted, form) not in twins_results:
        pytest.skip("no valid token on any rank: no token mean to take")
    for key in ((counts, weighted, form), (counts, weighted, form + " rank 1")):
        got = twins_results[key]
        assert got["error"] <= TOL and got["same_none"], (key, got)
        assert "unused.weight" in got["none"]


def test_twin_is_the_full_batch_in_one_process() -> None:
    """The twin itself: 8 microbatches of 4 samples in one process give the 32-sample full-batch gradient."""
    model = w.TinyMoE()
    pure = PureAccumulator(model.parameters())
    for batch in w.microbatches(8):
        with pure.microbatch():
            w.loss_of(model, batch).backward()
    pure.finish()
    assert w.max_error(w.grads_of(model), w.full_batch_grads(w.microbatches(8))) <= TOL


def test_a_known_wrong_accumulator_differs_from_the_twin() -> None:
    """Dividing by the last microbatch's weight instead of the total (a wrong divisor): visibly off the twin,
    so the comparison can fail."""
    data = twins.tw.token_batches(5)
    fast, slow = w.TinyMoE(), w.TinyMoE()
    acc = MicrobatchAccumulator(fast)
    twins.run(acc, fast, data, weighted=True)
    twins.run(PureAccumulator(slow.parameters()), slow, data, weighted=True)
    assert w.max_error(w.grads_of(fast), w.grads_of(slow)) <= TOL
    total, last = sum(int(b[3].sum()) for b in data), int(data[-1][3].sum())
    wrong = {n: None if g is None else g * total / last for n, g in w.grads_of(fast).items()}
    assert w.max_error(wrong, w.grads_of(slow)) > 1e-2
