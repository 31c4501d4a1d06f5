"""The demo's cases in one process: the ground truth is what it claims, and the data are what the demo says.

No process group is needed: the truth and each rank's rows are computed locally (the gather is not).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradagg.demo import data  # noqa: E402
from gradagg.demo.cases import MoeCase, TokenCase  # noqa: E402
from gradagg.demo.models import HEAD, IGNORE  # noqa: E402
from gradagg.demo.options import Config  # noqa: E402

Tensor = torch.Tensor
CFG = Config(steps=1, seed=3, counts=(3, 5))
# float64: the truth (one forward over the whole batch) and the sum of per-microbatch gradients add the
# same <= 8 * 16 token terms of order 1 in another order: a few ulps, far below 1e-12.
TOL = 1e-12


def _sum_rows(case: TokenCase | MoeCase, params: dict[str, torch.Tensor], batch: list[object]) -> dict[str, Tensor]:
    rows = case.rows(params, batch, None)
    out = {n: torch.zeros_like(t) for n, t in params.items()}
    for row in rows.grads:
        for n, g in row.items():
            if g is not None:
                out[n] += g
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_token_truth_is_the_token_mean_over_the_global_batch() -> None:
    """The truth (cross-entropy mean over the concatenated batch) = sum of the microbatches' summed-loss
    gradients / N, N = every valid token of all ranks; not / M: the lengths differ, so the two differ."""
    case = TokenCase()
    params, batch = case.start(CFG), case.batch(CFG, 0)
    n = sum(data.valid_tokens(y) for _, y in batch)
    summed = _sum_rows(case, params, batch)
    truth = case.truth(params, batch)
    assert _max_diff({k: v / n for k, v in summed.items()}, truth) <= TOL
    assert _max_diff({k: v / len(batch) for k, v in summed.items()}, truth) > 1e-3


def test_padding_is_ignored() -> None:
    """Padded positions have input PAD and target -100; the lengths differ; other tokens at the padded
    inputs change nothing, because their targets are ignored: the truth is the same to round-off."""
    case = TokenCase()
    params, batch = case.start(CFG), case.batch(CFG, 0)
    for x, y in batch:
        assert bool((x[y == IGNORE] == data.PAD).all())
    lengths = {int((y != IGNORE).sum(dim=1)[k]) for _, y in batch for k in range(data.SEQS)}
    assert len(lengths) > 2  # uneven lengths, as the demo claims
    noisy = [(x.masked_fill(y == IGNORE, 7), y) for x, y in batch]
    assert _max_diff(case.truth(params, noisy), case.truth(params, batch)) <= TOL


def test_moe_truth_is_the_mean_of_microbatch_losses_and_experts_are_absent() -> None:
    """The MoE truth = sum of microbatch gradients / M; some expert is absent (None) from some microbatch,
    and only the owner's (last rank's) microbatches give head_b a gradient."""
    case = MoeCase()
    params, batch = case.start(CFG), case.batch(CFG, 0)
    summed = _sum_rows(case, params, batch)
    assert _max_diff({k: v / len(batch) for k, v in summed.items()}, case.truth(params, batch)) <= TOL
    rows = case.rows(params, batch, None).grads
    assert any(g is None for row in rows for n, g in row.items() if n.startswith("experts."))
    assert [row[HEAD] is not None for row in rows] == [False] * 3 + [True] * 5


def test_evaluating_touches_no_gradient() -> None:
    """The truth, the rows and the held-out loss use autograd.grad on a plain copy: no .grad is left anywhere."""
    for case in (TokenCase(), MoeCase()):
        params, batch = case.start(CFG), case.batch(CFG, 0)
        case.truth(params, batch)
        case.rows(params, batch[:2], None)
        case.eval_loss(params, case.held_out(CFG))
        assert all(t.grad is None for t in params.values())
        assert all(p.grad is None for p in case.plain.parameters())
