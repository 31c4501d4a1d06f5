"""MicrobatchAccumulator in one process (no process group): the contract, the guards, no communication."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gradagg.errors import GradaggError, NonFiniteGradientError, WindowError
from gradagg.mutants import MICROBATCH_MEAN_MUTANTS
from gradagg.reference import microbatch_mean
from gradagg.torch import MicrobatchAccumulator, count_collectives
from tests.torch.workers import dist as w

# float64; sums of <= 8 microbatch gradients in another order than the full batch: see tests/torch/test_distributed.py.
TOL = 1e-12


def test_matches_full_batch_gradient() -> None:
    """8 microbatches of 4 samples: each .grad equals the full 32-sample gradient; ``unused`` stays None."""
    model = w.TinyMoE()
    acc, ledger = w.accumulate(model, w.microbatches(8))
    assert w.max_error(w.grads_of(model), w.full_batch_grads(w.microbatches(8))) <= TOL
    assert model.unused.weight.grad is None
    assert ledger.microbatches_global == ledger.divisor == 8
    assert ledger.participation_local["experts.2.weight"] == 4


def test_same_as_hand_written_scaled_loop() -> None:
    """(loss / M).backward() over the same M = 5 microbatches gives the same gradients (to round-off)."""
    batches = w.microbatches(5)
    hand = w.TinyMoE()
    for batch in batches:
        (w.loss_of(hand, batch) / len(batches)).backward()
    model = w.TinyMoE()
    w.accumulate(model, batches)
    assert w.max_error(w.grads_of(model), w.grads_of(hand)) <= TOL


def _scalar_params(width: int) -> list[torch.Tensor]:
    return [torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in range(width)]


def _run_rows(rows: list[list[float | None]]) -> list[float | None]:
    """Microbatch i gives parameter j the gradient rows[i][j] (loss = sum_j v_ij * p_j), None: absent."""
    params = _scalar_params(len(rows[0]))
    acc = MicrobatchAccumulator(params)
    for row in rows:
        with acc.microbatch():
            terms = [p * v for p, v in zip(params, row) if v is not None]
            if terms:
                torch.stack(terms).sum().backward()
    acc.finish()
    return [None if p.grad is None else float(p.grad) for p in params]


@pytest.mark.parametrize(
    ("rows", "want"),
    [
        ([[2.0, None], [4.0, 6.0]], [3.0, 3.0]),  # missing treated as zero: (2 + 4) / 2, (0 + 6) / 2
        ([[None, 2.0], [9.0, None], [3.0, 4.0]], [4.0, 2.0]),  # late participation: 12 / 3, 6 / 3
        ([[0.0, None], [4.0, 2.0]], [2.0, 1.0]),  # a zero gradient is present, not absent
        ([[None, 5.0]], [None, 5.0]),  # absent from the only microbatch: grad stays None
    ],
)
def test_case_fixtures(rows: list[list[float | None]], want: list[float | None]) -> None:
    """The case fixtures of the accumulation contract: sum / M, M = number of microbatches."""
    assert _run_rows(rows) == want


def test_against_reference_on_seeded_rows() -> None:
    """Seeded random rows with ~30% absent values: equal to reference.microbatch_mean (absent -> 0 there,
    None here only when absent everywhere); the known wrong fix (divide by participation) is caught."""
    seed = 20261129
    rng = random.Random(seed)
    for trial in range(20):
        m, width = rng.randint(1, 6), rng.randint(1, 5)
        rows = [[None if rng.random() < 0.3 else rng.uniform(-5, 5) for _ in range(width)] for _ in range(m)]
        got = _run_rows(rows)
        want = microbatch_mean(rows)
        for j, (g, v) in enumerate(zip(got, want)):
            absent_everywhere = all(r[j] is None for r in rows)
            assert (g is None) == absent_everywhere, (seed, trial, j)
            assert (0.0 if g is None else g) == pytest.approx(v, abs=1e-12), (seed, trial, rows)
    fixtures = [[[2.0, None], [4.0, 6.0]], [[None, None], [2.0, 4.0]]]  # the second: an all-absent microbatch
    for name, mutant in MICROBATCH_MEAN_MUTANTS.items():  # each known wrong fix disagrees somewhere
        caught = [
            rows for rows in fixtures if mutant(rows, [sum(v is not None for v in r) for r in rows]) != _run_rows(rows)
        ]
        assert caught, f"{name} is not caught"


def test_no_communication_without_process_group() -> None:
    """With no process group, finish() sends nothing (count 0) and needs no group at all."""
    model = w.TinyMoE()
    with count_collectives() as c:
        w.accumulate(model, w.microbatches(3))
    assert c.total == 0


def test_ledger_and_report() -> None:
    """Before finish: local counts, global None; after: M and participation, in a readable table."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    for batch in w.microbatches(4):
        with acc.microbatch():
            w.loss_of(model, batch).backward()
    assert acc.ledger.microbatches_local == 4 and acc.ledger.microbatches_global is None
    acc.finish()
    text = acc.report()
    assert "divisor M = 4" in text and "experts.2.weight" in text and "never a divisor" in text
    assert acc.ledger.participation_global == acc.ledger.participation_local


def test_backward_failure_poisons_the_window() -> None:
    """A microbatch raising after its backward: finish() raises WindowError until discard(); then a clean
    window works. A microbatch raising before any gradient (in the forward) is simply not counted."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    batches = w.microbatches(3)
    with pytest.raises(RuntimeError), acc.microbatch():
        raise RuntimeError("forward failed: nothing accumulated")
    with pytest.raises(RuntimeError), acc.microbatch():
        w.loss_of(model, batches[0]).backward()
        raise RuntimeError("failed after backward")
    with pytest.raises(WindowError, match="poisoned.*failed after backward"):
        acc.finish()
    acc.discard()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError), acc.microbatch():
        raise RuntimeError("forward failed again")
    for batch in batches:
        with acc.microbatch():
            w.loss_of(model, batch).backward()
    assert acc.finish().divisor == 3
    assert w.max_error(w.grads_of(model), w.full_batch_grads(batches)) <= TOL


def test_backward_outside_microbatch_poisons() -> None:
    """A backward between microbatches of an open window is not counted in M: finish() refuses."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    batch = w.microbatches(1)[0]
    with acc.microbatch():
        w.loss_of(model, batch).backward()
    w.loss_of(model, batch).backward()
    with pytest.raises(WindowError, match="outside microbatch"):
        acc.finish()


def test_guards() -> None:
    """finish() with M = 0; gradients left from before the window; nested microbatches; finish inside one."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    with pytest.raises(WindowError, match="M = 0"):
        acc.finish()
    w.loss_of(model, w.microbatches(1)[0]).backward()
    with acc.microbatch():  # refused in finish(), where every rank of a group refuses with it
        pass
    with pytest.raises(WindowError, match=r"'shared.weight' has a gradient from before the window: a backward ran "
                                          r"outside microbatch\(\)"):
        acc.finish()
    acc.discard()
    with acc.microbatch():
        with pytest.raises(WindowError, match="do not nest"), acc.microbatch():
            pass
        with pytest.raises(WindowError, match="inside microbatch"):
            acc.finish()
    with pytest.raises(GradaggError, match="nonfinite"):
        MicrobatchAccumulator(model, nonfinite="ignore")  # type: ignore[arg-type]


def test_next_window_requires_zeroed_gradients() -> None:
    """After finish() and the step, forgetting zero_grad() would mix two windows: that window's finish() refuses,
    naming the parameter, and leaves the gradients as they were until discard()."""
    model = w.TinyMoE()
    acc, _ = w.accumulate(model, w.microbatches(2))
    with acc.microbatch():
        w.loss_of(model, w.microbatches(1)[0]).backward()
    with pytest.raises(WindowError, match=r"parameter 'shared.weight' .*zero_grad\(\)"):
        acc.finish()
    acc.discard()
    with acc.microbatch():
        w.loss_of(model, w.microbatches(1)[0]).backward()
    assert acc.finish().divisor == 1


@pytest.mark.parametrize("leftover", ["zeros", "-0.0", "nan", "one non-zero"])
def test_gradients_zeroed_in_place_count_as_absent(leftover: str) -> None:
    """zero_grad(set_to_none=False) between windows (torchtitan's default): exact zeros are no contribution, so the
    next window is exactly the one after zero_grad(); -0.0 is a zero too; a NaN or any non-zero value is stale and
    refused in finish() (where every rank of a group refuses with it), naming that parameter."""
    model, fresh = w.TinyMoE(), w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    w.accumulate(model, w.microbatches(4), acc=acc)  # expert 2 gets a gradient here, none in the next window
    model.zero_grad(set_to_none=False)
    assert all(p.grad is not None for p in model.shared.parameters())
    if leftover == "-0.0":
        model.shared.weight.grad.fill_(-0.0)
    elif leftover != "zeros":
        model.experts[1].bias.grad[0] = math.nan if leftover == "nan" else 1e-30
    batches = w.microbatches(3)[1:]
    if leftover in ("zeros", "-0.0"):
        w.accumulate(model, batches, acc=acc)
        w.accumulate(fresh, batches)
        # the same sums, bit-identical; expert 2, absent from this window, None again (max_error: inf otherwise)
        assert w.max_error(w.grads_of(model), w.grads_of(fresh)) == 0.0
        return
    with acc.microbatch():
        pass  # no backward: the leftover must be refused even where nothing is added to it
    with pytest.raises(WindowError, match="'experts.1.bias' already has a non-zero gradient"):
        acc.finish()
    acc.discard()  # as the message says; the next window is clean
    w.accumulate(model, batches, acc=acc)
    w.accumulate(fresh, batches)
    assert w.max_error(w.grads_of(model), w.grads_of(fresh)) == 0.0


def test_nonfinite() -> None:
    """NaN in a microbatch: propagate (default) keeps NaN in .grad; nonfinite="raise" raises."""
    batch = w.microbatches(1)[0]
    bad = (batch[0].clone().fill_(float("nan")), batch[1], batch[2])
    model = w.TinyMoE()
    w.accumulate(model, [batch, bad])
    assert bool(model.shared.weight.grad.isnan().all())
    with pytest.raises(NonFiniteGradientError, match="shared.weight"):
        w.accumulate(w.TinyMoE(), [batch, bad], nonfinite="raise")


def test_tied_weights_and_plain_parameters() -> None:
    """A tensor given twice is one parameter (one hook, one gradient), not counted twice."""
    p = torch.zeros(2, requires_grad=True)
    acc = MicrobatchAccumulator([p, p])
    for v in (1.0, 3.0):
        with acc.microbatch():
            (p * v).sum().backward()
    acc.finish()
    assert p.grad.tolist() == [2.0, 2.0]  # (1 + 3) / 2
    assert list(acc.ledger.participation_local) == ["param[0]"]


def test_close_makes_it_unusable() -> None:
    """close() removes the hooks; using the accumulator afterwards is refused rather than silently uncounted."""
    p = torch.zeros(1, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    acc.close()
    with pytest.raises(WindowError, match="closed"), acc.microbatch():
        pass
    with pytest.raises(WindowError, match="closed"):
        acc.finish()


def test_second_finish_does_not_divide_twice() -> None:
    """finish() twice without a microbatch in between: the gradients of the first are still there, so the second
    refuses (as on every rank of a group) and leaves them unchanged."""
    model = w.TinyMoE()
    acc, _ = w.accumulate(model, w.microbatches(2))
    before = w.grads_of(model)
    with pytest.raises(WindowError, match="had gradients before its window"):
        acc.finish()
    assert w.max_error(w.grads_of(model), before) == 0.0
    acc.discard()
    with pytest.raises(WindowError, match="M = 0"):
        acc.finish()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")  # torch's, expected here
def test_a_backward_with_create_graph_keeps_the_buffer_out_of_the_graph() -> None:
    """A microbatch back-propagated with ``create_graph=True`` (a gradient penalty) runs the hooks with grad mode
    on: the gradient is still taken as values only, so ``.grad`` after finish() is the exact mean and has no
    history (the hook's fast path, with grad mode off, is not taken there)."""
    lin = torch.nn.Linear(3, 1, bias=False)
    xs = [torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.5, -1.0, 4.0]])]
    acc = MicrobatchAccumulator(lin)
    for x in xs:
        with acc.microbatch():
            (lin(x) ** 2).sum().backward(create_graph=True)
    acc.finish()
    w = lin.weight.detach().double()
    truth = sum(2 * (x.double() @ w.T) * x.double() for x in xs) / len(xs)
    assert lin.weight.grad is not None and not lin.weight.grad.requires_grad
    assert lin.weight.grad.grad_fn is None
    torch.testing.assert_close(lin.weight.grad.double(), truth, rtol=1e-6, atol=0)  # float32 sums of 2 terms
    acc.close()


def _two_dtypes(weights: list[float] | None) -> tuple[torch.Tensor, torch.Tensor, MicrobatchAccumulator]:
    """A float32 and a float64 parameter (the buffer is float64), run over 3 microbatches of gradients v, 2v."""
    a = torch.zeros(2, dtype=torch.float32, requires_grad=True)
    b = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    acc = MicrobatchAccumulator([("a", a), ("b", b)])
    for k, v in enumerate((1.0, 2.0, 6.0)):
        with acc.microbatch(None if weights is None else weights[k]):
            ((a * v).sum() + (b * 2 * v).sum()).backward()
    return a, b, acc


def test_the_ledger_of_an_unweighted_window_in_every_field() -> None:
    """Without weights: M per rank, no weight fields; before finish() no global field; a float32 parameter beside a
    float64 one gets its gradient in its own dtype (the buffer is float64)."""
    a, b, acc = _two_dtypes(None)
    before = acc.ledger
    assert (before.microbatches_local, before.microbatches_global, before.microbatches_per_rank) == (3, None, None)
    assert (before.divisor, before.weight_local, before.weight_per_rank, before.weight_global) == (None,) * 4
    ledger = acc.finish()
    assert (ledger.microbatches_global, ledger.microbatches_per_rank, ledger.divisor) == (3, (3,), 3)
    assert ledger.weighting == "unweighted"
    assert (ledger.weight_local, ledger.weight_per_rank, ledger.weight_global) == (None, None, None)
    assert ledger.participation_global == ledger.participation_local == {"a": 3, "b": 3}
    assert a.grad is not None and b.grad is not None
    assert (a.grad.dtype, b.grad.dtype) == (torch.float32, torch.float64)
    assert a.grad.tolist() == [3.0, 3.0] and b.grad.tolist() == [6.0, 6.0]  # (1 + 2 + 6) / 3, twice that


def test_the_ledger_of_a_weighted_window_in_every_field() -> None:
    """With weights 1, 2, 5: D = 8, this rank's total and the per-rank totals in the ledger, before finish() only the
    local total; the gradients are the summed losses' gradients over 8 (a weight counts what the loss summed), in
    each parameter's dtype."""
    a, b, acc = _two_dtypes([1.0, 2.0, 5.0])
    before = acc.ledger
    assert (before.weight_local, before.weight_per_rank, before.weight_global) == (8.0, None, None)
    ledger = acc.finish()
    assert ledger.weighting == "weighted"
    assert (ledger.divisor, ledger.weight_local, ledger.weight_per_rank, ledger.weight_global) == (8.0, 8.0, (8.0,),
                                                                                                   8.0)
    assert (ledger.microbatches_global, ledger.microbatches_per_rank) == (3, (3,))
    want = (1.0 + 2.0 + 6.0) / 8
    assert a.grad is not None and b.grad is not None and a.grad.dtype == torch.float32
    assert a.grad.tolist() == [want, want] and b.grad.tolist() == [2 * want, 2 * want]


def test_refusals_at_finish_say_when_the_gradient_came() -> None:
    """A .grad set by hand after the last microbatch, and one left before a finish() that ran no microbatch: each
    refusal says which (the first before any padding round could drop it, the second as no window opened)."""
    p = torch.zeros(2, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    with acc.microbatch():
        p.sum().backward()
    p.grad = torch.ones(2)
    with pytest.raises(WindowError, match=r"'p' has a \.grad set by hand after the window's last microbatch: no"):
        acc.finish()
    acc.discard()
    p.grad = torch.ones(2)
    with pytest.raises(WindowError, match="'p' already has a non-zero gradient yet this rank ran no microbatch"):
        acc.finish()
    acc.discard()
    acc.close()


def test_an_attached_optimizer_steps_after_each_explicit_finish() -> None:
    """finish() by hand, then the attached optimizer's step, window after window: each step takes the window just
    finished (the finishes are counted: a step finishes again only where none happened since the last)."""
    p = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    opt = torch.optim.SGD([p], lr=1.0)
    acc.attach(opt)
    for v in (2.0, 6.0, 10.0):
        with acc.microbatch():
            (p * v).sum().backward()
        assert acc.finish().divisor == 1
        opt.step()
        opt.zero_grad()
    assert p.tolist() == [-18.0, -18.0]
    with pytest.raises(WindowError, match="M = 0"):
        opt.step()  # no window since the last step: it finishes an empty one, refused
    acc.close()


def test_a_second_finish_is_told_apart_from_other_old_gradients() -> None:
    """finish() twice: the refusal says the parameter still holds the gradient the last finish() handed out (not the
    generic advice about gradients left before a window)."""
    p = torch.zeros(2, requires_grad=True)
    acc = MicrobatchAccumulator([("p", p)])
    with acc.microbatch():
        p.sum().backward()
    acc.finish()
    with pytest.raises(WindowError, match=r"'p' still holds the gradient the last finish\(\) handed out"):
        acc.finish()
    acc.close()
