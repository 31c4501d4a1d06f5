"""MicrobatchAccumulator in one process: weights, loss terms, the last microbatch, and the holes of issue 7.

No process group: the same code path as a world of one (no communication). The distributed versions of
these checks are in test_training.py.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, seed, settings

from gradagg.errors import GradaggError, WindowError
from gradagg.torch import MicrobatchAccumulator, count_collectives
from tests.torch.workers import dist as w
from tests.torch.workers import train as tw

TOL = 1e-12  # float64, <= 10 microbatch sums in another order than the full batch: see test_training.py


def test_weights_give_the_token_mean() -> None:
    """Weights = valid tokens (6, 2, 5, 0, 3): D = 16, the gradient of the mean over all 16 valid tokens;
    dividing by M = 5 instead would miss it."""
    data = tw.token_batches(5)
    model = w.TinyMoE()
    ledger = tw.run_weighted(model, MicrobatchAccumulator(model), data, lookahead=False)
    assert w.max_error(w.grads_of(model), tw.token_truth(data)) <= TOL
    assert ledger.divisor == ledger.weight_global == 16 and ledger.microbatches_global == 5
    scaled = {n: None if g is None else g * 16 / 5 for n, g in w.grads_of(model).items()}  # divided by M
    assert w.max_error(scaled, tw.token_truth(data)) > 0.01


def test_tensor_weights_and_the_ledger_before_finish() -> None:
    """0-dim tensor weights count like numbers; before finish the ledger shows the local weight only."""
    data = tw.token_batches(3)
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    for batch in data:
        with acc.microbatch(weight=batch[3].sum()):
            tw.token_loss_sum(model, batch).backward()
    assert acc.ledger.weight_local == 13.0 and acc.ledger.weight_global is None
    assert acc.finish().divisor == 13
    assert w.max_error(w.grads_of(model), tw.token_truth(data)) <= TOL


def test_a_reused_weight_tensor_counts_its_value_when_given() -> None:
    """One preallocated count updated in place between microbatches (``w.copy_(n)``): each microbatch counts the
    value it was given, 1 then 3 (D = 4, gradient (1 + 3) / 4 = 1); keeping the tensor counted 3 twice (D = 6)."""
    p = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    count = torch.zeros((), dtype=torch.int64)
    for n in (1, 3):
        count.copy_(torch.tensor(n))
        with acc.microbatch(weight=count):
            (p.sum() * n).backward()
    count.fill_(100)  # after the window's last microbatch, before finish(): counts nowhere
    assert acc.finish().divisor == 4
    assert p.grad is not None and torch.equal(p.grad, torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("bad", [True, "3", torch.ones(2), torch.tensor(1j), [1]])
def test_weight_of_the_wrong_type_is_refused_at_once(bad: object) -> None:
    """A bool, a string, a 1-d or complex tensor, a list: GradaggError before anything runs."""
    acc = MicrobatchAccumulator(w.TinyMoE())
    with pytest.raises(GradaggError, match="weight"), acc.microbatch(weight=bad):
        pass


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), torch.tensor(-2.0)])
def test_invalid_weight_values_poison_the_window(bad: object) -> None:
    """A negative, NaN or infinite weight: the microbatch runs, finish() refuses naming it (on every rank)."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    with acc.microbatch(weight=2):
        w.loss_of(model, w.microbatches(1)[0]).backward()
    with acc.microbatch(weight=bad):
        w.loss_of(model, w.microbatches(1)[0]).backward()
    with pytest.raises(WindowError, match="microbatch 1 has weight"):
        acc.finish()


def test_a_refused_window_names_its_remedy_apart_from_its_reason() -> None:
    """finish() refused: the message ends with the remedy; ``reason``, what a discarding wrapper reports, lacks it."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    with acc.microbatch(weight=-1):
        w.loss_of(model, w.microbatches(1)[0]).backward()
    with pytest.raises(WindowError) as caught:
        acc.finish()
    assert str(caught.value).endswith("; call discard() on every rank"), str(caught.value)
    assert caught.value.remedy == "call discard() on every rank"
    assert "microbatch 0 has weight" in caught.value.reason and "discard()" not in caught.value.reason
    acc.discard()


def test_mixed_weighting_and_zero_total_weight() -> None:
    """Weighted then unweighted: refused. All weights 0: no mean to take (D = 0), refused."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    for weight in (1, None):
        with acc.microbatch(weight=weight):
            w.loss_of(model, w.microbatches(1)[0]).backward()
    with pytest.raises(WindowError, match="is unweighted but the window's first was weighted"):
        acc.finish()
    acc.discard()
    with acc.microbatch(weight=0):
        w.loss_of(model, w.microbatches(1)[0]).backward()
    with pytest.raises(WindowError, match="total weight of the window is 0"):
        acc.finish()
    assert all(p.grad is None for p in model.parameters())


def test_divisors_counted_ahead() -> None:
    """Two terms, tokens (16) and microbatches (5), each divided by its own divisor: the full-batch loss; D = 1."""
    data = tw.token_batches(5)
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    div = acc.divisors({"tokens": 16, "microbatches": torch.tensor(5)})
    for batch in data:
        with acc.microbatch():
            loss = tw.token_loss_sum(model, batch) / div["tokens"] + tw.aux_loss(model, batch) / div["microbatches"]
            loss.backward()
    ledger = acc.finish()
    assert w.max_error(w.grads_of(model), tw.terms_truth(data)) <= TOL
    assert ledger.divisor == 1 and ledger.terms == div and "tokens by 16" in ledger.report()


def test_divisors_are_counted_exactly() -> None:
    """Counts float32 cannot hold (16777217, 0.1, 2**53) come back exact, a tensor count by its value: the
    all_reduce that sums them is float64."""
    acc = MicrobatchAccumulator([("p", torch.zeros(1, requires_grad=True))])
    counts = {"tokens": 16777217, "share": 0.1, "big": 2.0**53, "t": torch.tensor(16777217, dtype=torch.int64)}
    assert acc.divisors(counts) == {"tokens": 16777217.0, "share": 0.1, "big": 2.0**53, "t": 16777217.0}
    acc.close()


def test_divisors_misuse() -> None:
    """After the window's first microbatch, twice, a negative count, a term totalling 0, a weight: refused."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    with pytest.raises(GradaggError, match="totals 0"):
        acc.divisors({"tokens": 0})
    with pytest.raises(GradaggError, match="count -1.0"):
        acc.divisors({"tokens": -1})
    acc.divisors({"tokens": 4})
    with pytest.raises(WindowError, match="once per window"):
        acc.divisors({"tokens": 4})
    with acc.microbatch(weight=2):
        w.loss_of(model, w.microbatches(1)[0]).backward()
    with pytest.raises(WindowError, match="divided ahead"):
        acc.finish()


def test_lookahead_and_many_buckets_match() -> None:
    """microbatches() marks the last; with a 13-element bucket cap the early buckets are handed to the
    (absent) group during the last backward: the same gradients as without look-ahead, no communication."""
    batches = w.microbatches(4)
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model, bucket_mb=1e-4)
    with count_collectives() as c:
        for batch in acc.microbatches(batches):
            with acc.microbatch():
                w.loss_of(model, batch).backward()
        acc.finish()
    assert len(acc.state.layout().buckets) > 2 and c.total == 0
    assert w.max_error(w.grads_of(model), w.full_batch_grads(batches)) <= TOL


def test_second_backward_after_the_last_buckets_left_is_refused() -> None:
    """Two backwards in the microbatch marked last: the first already sent complete buckets, so the second's
    gradients would be lost: refused, not silently dropped."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))  # 20 + 5 elements: 2+ buckets
    acc = MicrobatchAccumulator(model, bucket_mb=1e-5)
    x = torch.ones(2, 4)
    with acc.microbatch(last=True):
        model(x).sum().backward()
        model(x).sum().backward()
    with pytest.raises(WindowError, match="after its bucket was sent"):
        acc.finish()


def test_microbatch_after_the_last_is_refused() -> None:
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    for last in (True, False):
        with acc.microbatch(last=last):
            w.loss_of(model, w.microbatches(1)[0]).backward()
    with pytest.raises(WindowError, match="after the microbatch marked last"):
        acc.finish()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_between_microbatches_drops_nothing(set_to_none: bool) -> None:
    """optimizer.zero_grad() before each of 3 microbatches: all 3 still count (full-batch gradient, M = 3)."""
    batches = w.microbatches(3)
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = MicrobatchAccumulator(model)
    for batch in batches:
        opt.zero_grad(set_to_none=set_to_none)
        with acc.microbatch():
            w.loss_of(model, batch).backward()
    assert acc.finish().divisor == 3
    assert w.max_error(w.grads_of(model), w.full_batch_grads(batches)) <= TOL


def test_unfrozen_after_construction_is_refused() -> None:
    """A module's frozen layer unfrozen later, or a frozen tensor given directly then unfrozen: refused."""
    model = w.TinyMoE()
    model.unused.requires_grad_(False)
    acc = MicrobatchAccumulator(model)
    model.unused.requires_grad_(True)
    with acc.microbatch():
        w.loss_of(model, w.microbatches(1)[0]).backward()
    with pytest.raises(WindowError, match="'unused.weight' was frozen"):
        acc.finish()
    frozen = torch.zeros(2)
    acc2 = MicrobatchAccumulator([("a", torch.zeros(2, requires_grad=True)), ("b", frozen)])
    frozen.requires_grad_(True)
    with pytest.raises(WindowError, match="'b' was frozen"):
        acc2.finish()


def test_complex_parameters_one_process() -> None:
    """Complex gradients are held as real and imaginary parts: .grad is complex again, equal to the full batch."""
    g = torch.Generator().manual_seed(4)
    zs = [torch.randn(2, 3, dtype=torch.complex128, generator=g) for _ in range(3)]
    model, truth = tw.ComplexNet(), tw.ComplexNet()
    acc = MicrobatchAccumulator(model)
    for z in zs:
        with acc.microbatch():
            model(z).pow(2).mean().backward()
    acc.finish()
    truth(torch.cat(zs)).pow(2).mean().backward()
    assert model.w.grad is not None and model.w.grad.dtype == torch.complex128
    assert w.max_error(w.grads_of(model), w.grads_of(truth)) <= TOL


def test_sparse_gradients_are_refused() -> None:
    emb = torch.nn.Embedding(4, 2, sparse=True)
    acc = MicrobatchAccumulator(emb)
    with acc.microbatch():
        emb(torch.tensor([1])).sum().backward()
    with pytest.raises(WindowError, match="sparse"):
        acc.finish()


def test_attach_one_process() -> None:
    """attach(): optimizer.step() runs finish() first, so the step uses the mean (M = 2); remove() detaches."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    acc = MicrobatchAccumulator([p])
    handle = acc.attach(opt)
    for v in (1.0, 3.0):
        with acc.microbatch():
            (p * v).sum().backward()
    opt.step()
    assert p.tolist() == [-2.0] and acc.ledger.divisor == 2
    handle.remove()
    opt.zero_grad()
    opt.step()  # no pre-hook now: finish() is not called (it would refuse M = 0)


def test_options_are_checked() -> None:
    with pytest.raises(GradaggError, match="bucket_mb"):
        MicrobatchAccumulator(w.TinyMoE(), bucket_mb=0)
    with pytest.raises(GradaggError, match="fsdp must be"):
        MicrobatchAccumulator(w.TinyMoE(), fsdp="sometimes")  # type: ignore[arg-type]


def test_reused_buffer_holds_nothing_stale() -> None:
    """The buffer is reused without zeroing: window 1 leaves NaN everywhere (nonfinite="raise" raises); window 2
    uses expert 0 only, so the other experts' slots still hold window 1's NaN: they are zeroed before they are
    sent, and window 2 is finite and right."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model, nonfinite="raise")
    x, y, route = w.microbatches(1)[0]
    with pytest.raises(GradaggError, match="non-finite"):
        w.accumulate(model, [(x.clone().fill_(float("nan")), y, torch.tensor([0, 1, 2, 0]))], acc=acc)
    model.zero_grad()
    only_expert_0 = [(x, y, torch.zeros(4, dtype=torch.long))]
    w.accumulate(model, only_expert_0, acc=acc)
    assert model.experts[1].weight.grad is None
    assert w.max_error(w.grads_of(model), w.full_batch_grads(only_expert_0)) <= TOL


# --- a .grad set by hand (issue 16) ------------------------------------------------------------------------

ACTIONS = st.sampled_from(["none", "before", "after"])


HAND_SET_SEED = 1616  # hypothesis's seed for test_hand_set_grads_count_in_their_microbatch
HAND_SET_CLASSES = ("set before a backward that reaches it", "set after a backward that reaches it",
                    "set where no backward reaches", "absent in the whole window")
hand_set: Counter[str] = Counter()


@seed(HAND_SET_SEED)
@settings(max_examples=60, deadline=None)
@given(plan=st.lists(st.tuples(ACTIONS, st.booleans(), ACTIONS, st.booleans()), min_size=1, max_size=4))
def hand_set_windows(plan: list[tuple[str, bool, str, bool]]) -> None:
    """One window of test_hand_set_grads_count_in_their_microbatch."""
    a, b = (torch.zeros(2, dtype=torch.float64, requires_grad=True) for _ in range(2))
    acc = MicrobatchAccumulator([("a", a), ("b", b)])
    want = [0.0, 0.0]
    present = [False, False]
    for k, (act_a, reach_a, act_b, reach_b) in enumerate(plan):
        with acc.microbatch():
            for p, act in ((a, act_a), (b, act_b)):
                if act == "before":
                    p.grad = torch.full_like(p, 10.0 * (k + 1))
            loss = sum(p.sum() * (k + 1) for p, reach in ((a, reach_a), (b, reach_b)) if reach)
            if isinstance(loss, torch.Tensor):
                loss.backward()
            for p, act in ((a, act_a), (b, act_b)):
                if act == "after":
                    p.grad = torch.full_like(p, 10.0 * (k + 1))
        for j, (act, reach) in enumerate(((act_a, reach_a), (act_b, reach_b))):
            if act != "none":
                hand_set[f"set {act} a backward that reaches it" if reach else "set where no backward reaches"] += 1
            want[j] += (k + 1) * reach + 10.0 * (k + 1) * (act != "none")
            present[j] = present[j] or reach or act != "none"
    acc.finish()
    for j, p in enumerate((a, b)):
        if not present[j]:
            assert p.grad is None
        else:
            assert p.grad is not None and torch.allclose(p.grad, torch.full_like(p, want[j] / len(plan)), rtol=1e-15)
        hand_set.update(["absent in the whole window"] * (not present[j]))


def test_hand_set_grads_count_in_their_microbatch() -> None:
    """Microbatch k, for each of two parameters: a backward reaches it or not (gradient k + 1), and a .grad is
    set by hand to 10 (k + 1) before the backward, after it, or not at all. Each counts in microbatch k,
    added to the backward's: the mean is sum_k (reached (k + 1) + set 10 (k + 1)) / M; absent everywhere: None.
    The windows drawn (HAND_SET_SEED) reach every class in HAND_SET_CLASSES."""
    hand_set.clear()
    hand_set_windows()
    assert all(hand_set[c] > 0 for c in HAND_SET_CLASSES), hand_set


def test_hand_set_between_microbatches_or_after_the_last_is_refused() -> None:
    """Set between two microbatches, or after the last one: no microbatch counts it, finish() refuses (WindowError
    naming the parameter) until discard()."""
    for where in ("between", "after"):
        p = torch.zeros(2, requires_grad=True)
        acc = MicrobatchAccumulator([("p", p)])
        for k in range(2):
            with acc.microbatch():
                p.sum().backward()
            if (where == "between" and k == 0) or (where == "after" and k == 1):
                p.grad = torch.ones_like(p)
        with pytest.raises(WindowError, match="'p' has a .grad set by hand"):
            acc.finish()
        acc.discard()


def test_hand_set_after_its_bucket_left_is_refused() -> None:
    """In the microbatch marked last, buckets leave during the backward: a .grad set afterwards on a parameter
    whose bucket already left cannot be added; finish() refuses instead of dropping it."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    acc = MicrobatchAccumulator(model, bucket_mb=1e-3)  # one bucket per parameter
    for x in acc.microbatches([torch.ones(1, 64)] * 2):
        with acc.microbatch():
            model(x).sum().backward()
            model[1].weight.grad = torch.ones_like(model[1].weight)  # its bucket left first
    with pytest.raises(WindowError, match="after its bucket was sent"):
        acc.finish()


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64]),
    seed=st.integers(0, 2**16),
)
def test_fingerprint_reads_values_not_layout(shape: list[int], dtype: torch.dtype, seed: int) -> None:
    """The digest that tells bare tensors apart across ranks: equal for equal values whatever the strides (a
    transposed copy, a clone), different when one element changes (its lowest bit flipped)."""
    from gradagg.torch.accumulate.opening import fingerprint

    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(shape, generator=g) * 100).to(dtype)
    strided = t.transpose(0, -1).contiguous().transpose(0, -1)  # the same values, other strides
    assert fingerprint(t) == fingerprint(t.clone()) == fingerprint(strided)
    flipped = t.clone().reshape(-1)
    flipped.view(torch.uint8)[0] ^= 1
    assert fingerprint(flipped.reshape(t.shape)) != fingerprint(t)
