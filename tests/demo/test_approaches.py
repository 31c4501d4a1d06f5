"""The demo's wrong approaches in closed form, and the gather that feeds them, without processes.

Each approach is the arithmetic of code people ship; the hand-computed cases pin the formulas, and the
properties say when each one happens to be right (its hidden assumption), which is also why the demo's
uneven counts and lengths are needed to expose it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradagg.demo import approaches as ap  # noqa: E402
from gradagg.demo.approaches import RankRows  # noqa: E402
from gradagg.demo.models import HEAD  # noqa: E402
from gradagg.demo.options import Config  # noqa: E402
from gradagg.demo.train import pack, unpack  # noqa: E402

# Sums of a few float64 terms in another order: a few ulps of values of order 10.
TOL = 1e-12


def _t(v: float) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float64)


def _values(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float(g) for n, g in grads.items()}


LIKE = {n: torch.zeros(1, dtype=torch.float64) for n in ("w", "e", HEAD)}
CFG = Config(steps=1, seed=0, counts=(3, 5))


def _moe_ranks() -> list[RankRows]:
    """Rank 0: 3 microbatches; "w" got 1 in each (sum 3), "e" 4 in the first only, head_b absent, a stale 7.
    Rank 1 (owner of head_b): 5 microbatches; "w" got 2 in each (sum 10), "e" absent, head_b 1 in each."""
    r0 = [{"w": _t(1), "e": _t(4) if i == 0 else None, HEAD: None} for i in range(3)]
    r1 = [{"w": _t(2), "e": None, HEAD: _t(1)} for _ in range(5)]
    return [RankRows(r0, [3] * 3, stale=_t(7)), RankRows(r1, [3] * 5)]  # type: ignore[arg-type]


def test_sum_over_m_is_the_right_mean() -> None:
    """M = 8: w = 13/8, e = 4/8 (absent counts as zero), head_b = 5/8 (only the owner computes it)."""
    assert _values(ap.sum_over_m(_moe_ranks(), LIKE, CFG)) == {"w": 13 / 8, "e": 0.5, HEAD: 5 / 8}


def test_divide_by_participation_is_off_for_the_absent_ones_only() -> None:
    """Through gradagg.mutants: w was present in all 8: right; e in 1: 4/1 instead of 4/8; head_b in 5: 5/5."""
    assert _values(ap.divide_by_participation(_moe_ranks(), LIKE, CFG)) == {"w": 13 / 8, "e": 4.0, HEAD: 1.0}


def test_mean_of_rank_means() -> None:
    """(S_0 / 3 + S_1 / 5) / 2: w = (1 + 2) / 2 = 1.5 instead of 13/8."""
    got = _values(ap.mean_of_rank_means(_moe_ranks(), LIKE, CFG))
    assert got == pytest.approx({"w": 1.5, "e": 4 / 3 / 2, HEAD: 0.5}, abs=TOL)


def test_replica_mistakes_read_the_stale_copy() -> None:
    """Through gradagg.mutants: head_b = the owner's 5/8 plus rank 0's stale 7 when summed; the stale 7 alone
    when rank 0 comes first. Without a stale copy yet (step 0) both are right."""
    assert _values(ap.sum_every_replica(_moe_ranks(), LIKE, CFG))[HEAD] == 7 + 5 / 8
    assert _values(ap.first_replica(_moe_ranks(), LIKE, CFG))[HEAD] == 7.0
    fresh = _moe_ranks()
    fresh[0].stale = None
    assert _values(ap.sum_every_replica(fresh, LIKE, CFG))[HEAD] == _values(ap.first_replica(fresh, LIKE, CFG))[HEAD]


def _token_ranks() -> list[RankRows]:
    """Rank 0: one microbatch of 2 tokens, summed gradient 4. Rank 1: microbatches of 6 and 2 tokens,
    summed gradients 6 and 2 (every token contributes 1, except rank 0's, which contribute 2).
    N = 10 tokens, M = 3: the token mean is (4 + 6 + 2) / 10 = 1.2."""
    return [RankRows([{"w": _t(4)}], [2]), RankRows([{"w": _t(6)}, {"w": _t(2)}], [6, 2])]  # type: ignore[list-item]


TOKEN_CFG = Config(steps=1, seed=0, counts=(1, 2))
TOKEN_LIKE = {"w": torch.zeros(1, dtype=torch.float64)}


def test_token_mistakes_in_closed_form() -> None:
    """Against the token mean 1.2: the mean of token means (2 + 1 + 1) / 3 = 4/3; each rank's own token
    mean averaged over W = 2, (4/2 + 8/8) / 2 = 1.5; divided by M = 3 microbatches, 12 / 3 = 4."""
    ranks = _token_ranks()
    assert float(ap.mean_of_token_means(ranks, TOKEN_LIKE, TOKEN_CFG)["w"]) == pytest.approx(4 / 3, abs=TOL)
    assert float(ap.local_tokens_times_world(ranks, TOKEN_LIKE, TOKEN_CFG)["w"]) == pytest.approx(1.5, abs=TOL)
    assert float(ap.sum_over_m(ranks, TOKEN_LIKE, TOKEN_CFG)["w"]) == pytest.approx(4.0, abs=TOL)


def _token_mean(ranks: list[RankRows]) -> float:
    total = sum(float(g["w"]) for rank in ranks for g in rank.grads)  # type: ignore[arg-type]
    return total / sum(sum(rank.tokens) for rank in ranks)


@st.composite
def _token_world(draw: st.DrawFn, equal: str) -> tuple[list[RankRows], Config]:
    """2-4 ranks, 1-4 microbatches each, 1-16 tokens and a gradient in [-10, 10] per microbatch.

    ``equal``: what the drawn world has equal: "tokens per microbatch", "tokens per rank" or "counts".
    """
    world = draw(st.integers(2, 4))
    if equal == "tokens per microbatch":
        counts = [draw(st.integers(1, 4)) for _ in range(world)]
    else:  # equal totals per rank here come from one layout of lengths, which fixes the counts too
        counts = [draw(st.integers(1, 4))] * world
    same = draw(st.integers(1, 16))
    layout = [draw(st.integers(1, 16)) for _ in range(counts[0])]
    ranks = []
    for count in counts:
        if equal == "tokens per microbatch":
            tokens = [same] * count
        elif equal == "tokens per rank":
            tokens = list(layout)
        else:
            tokens = [draw(st.integers(1, 16)) for _ in range(count)]
        grads = [{"w": _t(draw(st.floats(-10, 10)))} for _ in range(count)]
        ranks.append(RankRows(grads, tokens))  # type: ignore[arg-type]
    return ranks, Config(steps=1, seed=0, counts=tuple(counts))


def _sum_over_m(ranks: list[RankRows], cfg: Config) -> float:
    return float(ap.sum_over_m(ranks, TOKEN_LIKE, cfg)["w"])


@pytest.mark.parametrize(
    ("combine", "equal", "right"),
    [
        # every microbatch holds n tokens: (1/M) sum_i g_i / n = sum_i g_i / (M n), the token mean
        (ap.mean_of_token_means, "tokens per microbatch", lambda ranks, cfg: _token_mean(ranks)),
        # N_r = N / W on every rank: (1/W) sum_r S_r / N_r = sum_r S_r / N, the token mean
        (ap.local_tokens_times_world, "tokens per rank", lambda ranks, cfg: _token_mean(ranks)),
        # m_r = M / W on every rank: (1/W) sum_r S_r / m_r = sum S / M
        (ap.mean_of_rank_means, "counts", _sum_over_m),
    ],
    ids=["token means, equal lengths", "local tokens x W, equal rank totals", "rank means, equal counts"],
)
@settings(max_examples=60, deadline=None)
@given(drawn=st.data())
def test_each_mistake_is_right_when_its_assumption_holds(
    combine: ap.Combine, equal: str, right: Callable[[list[RankRows], Config], float], drawn: st.DataObject
) -> None:
    """Each wrong approach hides one assumption; in a world where it holds, it equals the right mean."""
    ranks, cfg = drawn.draw(_token_world(equal))
    assert float(combine(ranks, TOKEN_LIKE, cfg)["w"]) == pytest.approx(right(ranks, cfg), abs=TOL)


def test_the_demo_uneven_world_breaks_every_assumption() -> None:
    """The hand case above has unequal lengths, unequal rank totals and unequal counts: all three wrong."""
    ranks, truth = _token_ranks(), _token_mean(_token_ranks())
    for combine in (ap.mean_of_token_means, ap.local_tokens_times_world, ap.sum_over_m):
        assert abs(float(combine(ranks, TOKEN_LIKE, TOKEN_CFG)["w"]) - truth) > 0.1, combine.__name__


# --- the gather: what each rank computed arrives unchanged --------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    present=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=0, max_size=4),
    extra_slots=st.integers(0, 2),
    stale=st.none() | st.floats(-1e300, 1e300),
    tokens=st.integers(0, 2**40),
)
def test_pack_unpack_round_trip(present: list[tuple[bool, bool, bool]], extra_slots: int, stale: float | None,
                                tokens: int) -> None:
    """Any pattern of absent parameters, fewer microbatches than slots, a stale copy or none: unpack(pack(x)) is
    x, with absent still None (not a zero) and token counts exact (whole numbers below 2**53 in float64)."""
    like = {"a": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(1, dtype=torch.float64),
            HEAD: torch.zeros(2, dtype=torch.float64)}
    gen = torch.Generator().manual_seed(len(present))
    rows = [{n: torch.randn(like[n].shape, generator=gen, dtype=torch.float64) if p else None
             for n, p in zip(like, flags)} for flags in present]
    copy = None if stale is None else torch.full((2,), stale, dtype=torch.float64)
    local = RankRows(rows, [tokens + i for i in range(len(rows))], copy)
    back = unpack(pack(local, like, len(rows) + extra_slots), like, len(rows))
    assert back.tokens == local.tokens
    for got, want in zip(back.grads, local.grads):
        assert {n: g is None for n, g in got.items()} == {n: g is None for n, g in want.items()}
        assert all(torch.equal(got[n], want[n]) for n in want if want[n] is not None)  # type: ignore[arg-type]
    assert (back.stale is None) == (local.stale is None)
    assert back.stale is None or torch.equal(back.stale, local.stale)  # type: ignore[arg-type]
