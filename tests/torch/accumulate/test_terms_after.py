"""Loss terms counted as the window runs (issue 23 item 2): ``terms=``, ``mb.backward(term, loss, count=)``,
``acc.count(term, n)``; each term's gradient summed over the window on all ranks and divided by its own count.

The truth is the float64 one-process backward of the window's loss (see :mod:`tests.torch.workers.terms_after`).
Tolerance 1e-12: float64 sums of a few dozen terms of size ~1 (each rank's sum is divided before the ranks' sums
are added, a different rounding order from the truth's); every wrong divisor below misses by more than 1e-3.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.testing import run_local_world
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.modes import token_mean
from gradagg.torch.pure import PureAccumulator
from tests.torch.workers import terms_after as tw

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}  # DDP's import
TOL = 1e-12
SEED, FUZZ = 20261203, 4


@pytest.fixture(scope="module")
def exact() -> list[dict[str, Any]]:
    return run_local_world(tw.exact_world, 2, SEED, FUZZ, **WORLD)


@pytest.mark.parametrize("split", ["uneven", "zero"])
@pytest.mark.parametrize("kind", ["plain", "ddp", "pure"])
def test_four_terms_exact(exact: list[dict[str, Any]], split: str, kind: str) -> None:
    """policy (token-mean), kl (seq-mean-token-mean), nll (its count only after the last microbatch), value (1 per
    microbatch): 3 and 1 microbatches per rank, or 0 and 4; every rank's gradient is the one-process truth's."""
    for r in exact:
        assert r[f"{split}/{kind}"] < TOL, (split, kind, r[f"{split}/{kind}"])


def test_ledger_names_each_terms_count(exact: list[dict[str, Any]]) -> None:
    """The ledger gives each term's global count (the divisor its sum was divided by) and this rank's: the value
    term counts the window's 4 microbatches; rank 0 of the 'zero' split counted nothing."""
    for r in exact:
        terms, local, weighting, report = r["zero/ledger"]
        assert weighting == "terms" and terms["value"] == 4.0, terms
        assert "each loss term divided by its count on all ranks" in report and "value by 4" in report, report
    assert exact[0]["zero/ledger"][1] == dict.fromkeys(tw.TERMS, 0.0)
    assert exact[0]["uneven/ledger"][0] == exact[1]["uneven/ledger"][0]


def test_fuzz_random_splits_keep_the_gradient(exact: list[dict[str, Any]]) -> None:
    """Seeded random splits of the one window into ranks and microbatches (zero on a rank included): the
    gradient stays the one-process one, while each microbatch, or each rank, divided by its own count misses."""
    reached: Counter[str] = Counter()
    for split, err, wrong in exact[0]["fuzz"]:
        assert err < TOL, (f"seed {SEED}", split, err)
        if sum(len(m) for m in split) > 1:
            reached["several microbatches"] += 1
            assert wrong["per_microbatch"] > 1e-3, (f"seed {SEED}", split, wrong)
        if sum(1 for m in split if m) > 1:
            reached["several ranks with microbatches"] += 1
            assert wrong["per_rank"] > 1e-3, (f"seed {SEED}", split, wrong)
    assert all(err < TOL for _, err, _ in exact[1]["fuzz"])
    # the classes the checks above are about, each drawn at least once by the seed (the zero split is fixed above)
    assert reached["several microbatches"] and reached["several ranks with microbatches"], (SEED, reached)


def test_three_ranks_a_term_on_one_rank_only() -> None:
    """3 ranks, rank 1 runs no microbatch, only rank 2 runs the value term (D_value = its 3 microbatches)."""
    results = run_local_world(tw.three_world, 3, **WORLD)
    for r in results:
        assert r["error"] < TOL, r
        assert r["terms"]["value"] == 3.0, r["terms"]
    assert results[1]["terms_local"] == dict.fromkeys(tw.TERMS, 0.0)


@pytest.fixture(scope="module")
def refused() -> list[dict[str, Any]]:
    return run_local_world(tw.refusals_world, 2, **WORLD)


REFUSALS = [
        ("plain_backward", "WindowError", "rank 0 could not count its loss terms", "outside mb.backward"),
        ("forgotten_count", "WindowError", "'nll' counts 0 on all ranks, but its gradient is non-zero", ""),
        ("names_differ", "CollectiveError", "loss terms (terms=)", ""),
        ("weight", "WindowError", "invalid or inconsistent microbatch weight", "has weight=, but"),
        ("divisors", "GradaggError", "divisors() on an accumulator built with terms=", ""),
        ("unknown_term", "WindowError", "'polcy', not one of the accumulator's terms", ""),
        ("negative_count", "WindowError", "rank 1 could not count its loss terms", "'policy' was given count -2.0"),
        ("nonfinite", "NonFiniteGradientError", "non-finite gradients on rank(s) [0]", ""),
        ("hand_set", "WindowError", "rank 1 could not count its loss terms", "outside mb.backward"),
]


@pytest.mark.parametrize(("case", "kind", "everywhere", "where_it_happened"), REFUSALS)
def test_refused_on_every_rank(
    refused: list[dict[str, Any]], case: str, kind: str, everywhere: str, where_it_happened: str
) -> None:
    """Each misuse raises the same kind of error on both ranks (the world's 5 s collective timeout would show a
    rank left waiting as a CollectiveError naming a timeout), every message naming the rank or the term, and the
    rank where it happened saying what it was."""
    for r in refused:
        got = r[case]
        assert got is not None and got[0] == kind, (case, got)
        assert everywhere in got[1], (case, got[1])
    assert any(where_it_happened in r[case][1] for r in refused), [r[case] for r in refused]


def test_a_term_counting_zero_with_a_zero_gradient_contributes_nothing(refused: list[dict[str, Any]]) -> None:
    """No token survived the nll filter anywhere: its loss is 0 * ..., count 0 on every rank; allowed, recorded 0;
    also where only rank 0 ran it (rank 1, holding no sum of it, must not take the window's buffer for its sum)."""
    for r in refused:
        assert r["zero_count_zero_grad"] is None, r["zero_count_zero_grad"]
        assert r["zero_count_one_rank"] is None, r["zero_count_one_rank"]
        terms = r["zero_count_terms"]
        assert terms["nll"] == 0.0 and terms["kl"] == 0.0 and terms["policy"] > 0, terms


# --- one process ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_rank", [0, 1])
def test_refusals_in_one_process(monkeypatch: pytest.MonkeyPatch, as_rank: int) -> None:
    """The refusals above with no process group (the workers' rank-dependent cases played as rank 0, then 1):
    each misuse this process makes is refused as on the ranks, the message saying what it was; a term counting 0
    with a zero gradient passes, recorded 0 (mutmut's run starts no world: this is what reaches terms_after's
    checks there)."""
    monkeypatch.setattr(tw.dist, "get_rank", lambda group=None: as_rank)
    got = tw.refusals_world()
    mine = {"plain_backward": 0, "nonfinite": 0, "negative_count": 1, "hand_set": 1}  # the rank each happens on
    for case, kind, everywhere, where_it_happened in REFUSALS:
        if case == "names_differ" or mine.get(case, as_rank) != as_rank:
            assert case == "names_differ" or got[case] is None, (case, got[case])  # one process: nothing differs
            continue
        assert got[case] is not None and got[case][0] == kind, (case, got[case])
        assert everywhere.replace("rank 1", "rank 0") in got[case][1] and where_it_happened in got[case][1], got[case]
    assert got["zero_count_zero_grad"] is None and got["zero_count_terms"]["nll"] == 0.0, got
    assert got["zero_count_one_rank"] is None, got


def _acc(*terms: str) -> tuple[torch.Tensor, MicrobatchAccumulator]:
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)
    return w, MicrobatchAccumulator([("w", w)], terms=terms or None)


ONE_PROCESS: list[tw.Split] = [[[[0, 1, 2], [3], [4, 5], [6, 7, 8, 9]]], [[[5], [0, 1, 2, 3, 4, 6, 7, 8, 9]]]]


def _counts(split: tw.Split) -> dict[str, float]:
    """Each term's count over the window, by a Python walk over its mask: valid tokens (policy), sequences with one
    (kl), the filter's survivors (nll), microbatches (value)."""
    x, y, mask, _ = tw.window()
    with torch.no_grad():
        pi, _ = tw.Model()(x)
    rows = mask.tolist()
    survivors = sum(1 for s in range(tw.N) for t in range(tw.L)
                    if rows[s][t] and float((pi[s, t] - y[s, t]) ** 2) < tw.CUT)
    return {"policy": float(sum(map(sum, rows))), "kl": float(sum(1 for r in rows if any(r))),
            "nll": float(survivors), "value": float(sum(len(m) for m in split))}


@pytest.mark.parametrize("kind", ["plain", "pure"])
@pytest.mark.parametrize("split", range(len(ONE_PROCESS)), ids=["four microbatches", "two microbatches"])
def test_four_terms_exact_in_one_process(kind: str, split: int) -> None:
    """The four terms with no process group (the same code as every rank's): the one-process truth within TOL, each
    term divided by its count over the window (the ledger's, checked by a Python count), which each microbatch's
    own count misses."""
    mine = ONE_PROCESS[split]
    model = tw.Model()
    acc: Any = PureAccumulator(list(model.parameters()), terms=tw.TERMS) if kind == "pure" else (
        MicrobatchAccumulator(model, terms=tw.TERMS, bucket_mb=8 * 8 / 2**20))
    tw.run(acc, model, mine[0])
    ledger = acc.finish()
    assert tw.max_error(tw.grads_of(model), tw.truth(mine)) < TOL, (kind, mine)
    assert tw.max_error(tw.truth(mine, how="per_microbatch"), tw.truth(mine)) > 1e-3
    if kind == "plain":
        acc.close()
        assert ledger.terms == ledger.terms_local == _counts(mine), (ledger.terms, _counts(mine))
        assert ledger.weighting == "terms"


def test_misuse_raises_at_once() -> None:
    """Type and configuration errors raise where they happen."""
    w, plain = _acc()
    with plain.microbatch() as mb, pytest.raises(GradaggError, match="needs an accumulator built with terms="):
        mb.backward("a", w.sum())
    with pytest.raises(GradaggError, match="count"):
        plain.count("a", 1)
    plain.discard()
    plain.close()
    for bad in (("a", "a"), ("",), ()):
        with pytest.raises(GradaggError, match="distinct non-empty names"):
            _acc(*bad) if bad else MicrobatchAccumulator([torch.ones(1, requires_grad=True)], terms=[])
    w, acc = _acc("a")
    with acc.microbatch() as mb:
        with pytest.raises(GradaggError, match="carries its count"):
            mb.backward("a", token_mean(w[None, :], torch.ones(1, 2)), count=3)
        with pytest.raises(GradaggError, match="real number"):
            mb.backward("a", w.sum(), count="3")
    with pytest.raises(WindowError, match="outside its microbatch"):
        mb.backward("a", w.sum())
    acc.close()


def test_extra_buffers_are_one_per_term_beyond_the_first_and_freed() -> None:
    """Three terms in a window hold two extra buffers of the flat buffer's size until finish(), none after:
    the memory figure of the docstring, (terms - 1) x the flat buffer."""
    w, acc = _acc("a", "b", "c")
    with acc.microbatch() as mb:
        for k, t in enumerate("abc"):
            mb.backward(t, (k + 1) * w.sum(), count=k + 1)
        sums = acc.state.window.term_sums
        assert sums is not None and sorted(sums.bufs) == ["b", "c"] and sums.main == "a"
        assert all(b.numel() == acc.state.layout().size for b in sums.bufs.values())
    ledger = acc.finish()
    assert w.grad is not None and torch.equal(w.grad, torch.full((2,), 3.0, dtype=torch.float64))  # 1/1 + 2/2 + 3/3
    assert ledger.terms == {"a": 1.0, "b": 2.0, "c": 3.0} and acc.state.window.term_sums is None
    acc.close()


@pytest.mark.parametrize(("count", "words"), [(1e39, "is beyond what float32 sums can be divided by"),
                                              (1e-39, "is below the smallest normal float32")])
def test_a_term_count_its_dtype_cannot_divide_by_is_refused(count: float, words: str) -> None:
    """A term's count outside what the float32 buffer can be divided by (its gradient would become 0 or inf): refused,
    in the words finish() refuses a window's total weight with (counting.divisor_problem, one rule)."""
    w = torch.ones(2, requires_grad=True)
    acc = MicrobatchAccumulator([("w", w)], terms=["a"])
    with acc.microbatch() as mb:
        mb.backward("a", w.sum(), count=count)
    with pytest.raises(WindowError, match=re.escape(f"loss term 'a' counts {count!r} on all ranks, {words}")):
        acc.finish()
    acc.discard()
    acc.close()


def test_fsdp2_window_form_exact_and_shards_form_refused() -> None:
    """fully_shard, fsdp='window': the flat buffer is the window's, so terms work as on plain modules (uneven split,
    and a rank with none); the shards form reduces each backward itself and is refused, naming fsdp='window'."""
    for r in run_local_world(tw.fsdp_world, 2, **WORLD):
        for split in ("uneven", "zero"):
            assert r[split][0] < TOL, (split, r[split])
        assert r["shards"] is not None and r["shards"][0] == "GradaggError" and "fsdp='window'" in r["shards"][1]


def test_a_count_of_an_unknown_term_is_refused_at_finish() -> None:
    """acc.count() of a term the accumulator was not built with: finish() refuses the window, naming it."""
    w, acc = _acc("a")
    with acc.microbatch() as mb:
        mb.backward("a", w.sum(), count=1)
    acc.count("b", 2)
    with pytest.raises(WindowError, match=r"count\(\) of loss term 'b', not one of the accumulator's terms"):
        acc.finish()
    acc.discard()
    acc.close()


def test_a_part_carries_its_count_and_a_term_counting_zero_divides_nothing() -> None:
    """mb.backward(term, part): a Part's loss and its weight as the count; a term whose count and gradient are 0
    on all ranks (main or not) adds nothing and is not divided by its 0; a count float32 cannot hold (16777217)
    divides exactly (float64 here)."""
    for order in (("tok", "zero"), ("zero", "tok")):  # the first term backward'ed is the main one (the flat buffer)
        w, acc = _acc(*order)
        loss, mask = torch.stack([w[0] * 2.0, w[1] * 4.0])[None, :], torch.ones(1, 2)
        with acc.microbatch() as mb:
            for term in order:
                if term == "tok":
                    mb.backward("tok", token_mean(loss, mask), retain_graph=True)  # (2 w0 + 4 w1) over 2 tokens
                else:
                    mb.backward("zero", 0.0 * w.sum(), count=0, retain_graph=True)
            mb.backward("tok", 16777217.0 * w.sum(), count=16777217)
        ledger = acc.finish()
        assert ledger.terms == {"tok": 16777219.0, "zero": 0.0}, (order, ledger.terms)
        want = [(2.0 + 16777217.0) / 16777219.0, (4.0 + 16777217.0) / 16777219.0]
        assert w.grad is not None and w.grad.tolist() == want, (order, w.grad)
        acc.close()


def test_a_main_term_never_counted_is_refused() -> None:
    """The first term's gradient (in the window's own buffer) with no count anywhere: refused, not divided by 0."""
    w, acc = _acc("a", "b")
    with acc.microbatch() as mb:
        mb.backward("a", w.sum(), retain_graph=True)
        mb.backward("b", w.sum(), count=1)
    with pytest.raises(WindowError, match="'a' counts 0 on all ranks, but its gradient is non-zero"):
        acc.finish()
    acc.discard()
    acc.close()


def test_a_microbatch_handle_used_in_a_later_microbatch_is_refused() -> None:
    w, acc = _acc("a")
    with acc.microbatch() as first:
        first.backward("a", w.sum(), count=1)
    with acc.microbatch(), pytest.raises(WindowError, match="outside its microbatch"):
        first.backward("a", w.sum(), count=1)
    acc.discard()
    acc.close()


def test_one_term_named_by_a_string_and_a_part_keeping_its_graph() -> None:
    """terms="policy" is one term named policy (not one per letter); mb.backward(term, part, retain_graph=True)
    keeps the forward's graph for a second term back-propagated through it."""
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)
    acc = MicrobatchAccumulator([("w", w)], terms="policy")
    with acc.microbatch() as mb:
        mb.backward("policy", 3.0 * w.sum(), count=2)
    assert acc.finish().terms == {"policy": 2.0}
    assert w.grad is not None and w.grad.tolist() == [1.5, 1.5]
    acc.close()
    w.grad = None
    w, acc = _acc("tok", "kl")
    with acc.microbatch() as mb:
        shared = (w * torch.tensor([2.0, 4.0], dtype=torch.float64))[None, :]  # one forward, two terms
        mb.backward("tok", token_mean(shared, torch.ones(1, 2)), retain_graph=True)  # (2 w0 + 4 w1), 2 tokens
        mb.backward("kl", shared.sum(), count=1)  # through the same graph: it must have been kept
    assert acc.finish().terms == {"tok": 2.0, "kl": 1.0}
    assert w.grad is not None and w.grad.tolist() == [2.0 / 2 + 2.0, 4.0 / 2 + 4.0]
    acc.close()
