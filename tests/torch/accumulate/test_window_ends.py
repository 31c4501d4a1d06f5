"""What a window leaves behind when it ends: nothing. And the refusals that name what happened.

A loop may leave ``acc.microbatches(...)`` early (``continue`` past its last item, ``break``); whatever the
look-ahead set must not reach the next window. The property test runs random interleavings of
``microbatches()``, ``microbatch()``, ``finish()`` and ``discard()`` in one process and checks each window
against the float64 truth of exactly the microbatches it ran.
"""

from __future__ import annotations

import random

import pytest
import torch

from gradagg.errors import WindowError
from gradagg.torch import MicrobatchAccumulator

TOL = 1e-12  # float64, a handful of microbatch sums in another order than the one-pass truth


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def _batch(k: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 3 * (k % 3 + 1), dtype=torch.float64).reshape(-1, 3) * (k + 1)


def _truth(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    full = torch.cat(batches)
    (model(full).pow(2).sum() / len(full)).backward()
    out = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return out


def _run(acc: MicrobatchAccumulator, model: torch.nn.Module, batch: torch.Tensor) -> None:
    with acc.microbatch(weight=len(batch)):
        model(batch).pow(2).sum().backward()


def test_continue_past_the_last_item_leaves_the_next_window_untouched() -> None:
    """The last item skipped with ``continue``: the look-ahead's "next is last" must not mark the next window's
    first microbatch last (its second was refused as running after the last)."""
    model = _model()
    acc = MicrobatchAccumulator(model)
    first = [_batch(0), _batch(1), _batch(2)]
    for k, batch in enumerate(acc.microbatches(first)):
        if k == 2:
            continue
        _run(acc, model, batch)
    acc.finish()
    second = [_batch(3), _batch(4)]
    want = _truth(model, second)  # no step between the windows: the same parameters
    for batch in second:
        _run(acc, model, batch)
    acc.finish()
    got = [p.grad for p in model.parameters()]
    assert max(float((g - t).abs().max()) for g, t in zip(got, want)) <= TOL  # type: ignore[operator]


def test_break_out_of_microbatches_then_discard_leaves_nothing() -> None:
    model = _model()
    acc = MicrobatchAccumulator(model)
    for k, batch in enumerate(acc.microbatches([_batch(0), _batch(1)])):
        _run(acc, model, batch)
        if k == 0:
            break
    acc.discard()
    for batch in acc.microbatches([_batch(5)]):
        _run(acc, model, batch)
    _run(acc, model, _batch(6))  # a plain microbatch after the look-ahead's last one: refused, as documented
    with pytest.raises(WindowError, match="after the microbatch marked last"):
        acc.finish()
    acc.discard()


_ACTIONS = ("lookahead_full", "lookahead_continue_last", "lookahead_break", "plain", "finish", "discard")


def _lookahead(acc: MicrobatchAccumulator, model: torch.nn.Module, items: list[torch.Tensor], how: str,
               ran: list[torch.Tensor]) -> bool:
    """Run ``items`` through ``acc.microbatches``, left as ``how`` says; whether a microbatch marked last ran."""
    for j, batch in enumerate(acc.microbatches(items)):
        last = j == len(items) - 1
        if how == "continue_last" and last:
            continue
        _run(acc, model, batch)
        ran.append(batch)
        if how == "break":
            return last
    return how == "full"


def test_random_interleavings_each_window_is_exactly_its_own_microbatches() -> None:
    """Seeded: every window's result is the float64 token mean of exactly the microbatches it ran, whatever the
    previous window did (look-ahead run through, left by ``continue`` or ``break``, discarded)."""
    seed = 20261205
    rng = random.Random(seed)
    reached = dict.fromkeys(_ACTIONS, 0)
    model = _model()
    acc = MicrobatchAccumulator(model)
    ran: list[torch.Tensor] = []
    finished = 0
    for step in range(160):
        action = rng.choice(_ACTIONS)
        reached[action] += 1
        items = [_batch(rng.randrange(50) + j) for j in range(rng.randint(1, 3))]
        marked_last = False
        if action.startswith("lookahead_"):
            marked_last = _lookahead(acc, model, items, action.removeprefix("lookahead_"), ran)
        elif action == "plain":
            _run(acc, model, items[0])
            ran.append(items[0])
        elif action == "discard":
            acc.discard()
            ran = []
        if action == "finish" or marked_last:  # after a microbatch marked last, the window ends
            if not ran:
                with pytest.raises(WindowError, match="M = 0"):
                    acc.finish()
            else:
                want = _truth_keeping(model, ran)
                acc.finish()
                got = [p.grad for p in model.parameters()]
                err = max(float((g - t).abs().max()) for g, t in zip(got, want))  # type: ignore[operator]
                assert err <= TOL, f"seed {seed}, step {step}: error {err}"
                finished += 1
                model.zero_grad(set_to_none=True)
            ran = []
    assert all(reached.values()), f"seed {seed}: classes reached {reached}"
    assert finished > 10, f"seed {seed}: only {finished} windows finished"


def _truth_keeping(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The truth computed with no gradient present during the window: a functional call, .grad untouched."""
    params = dict(model.named_parameters())
    full = torch.cat(batches)
    loss = torch.func.functional_call(model, params, (full,)).pow(2).sum() / len(full)
    return list(torch.autograd.grad(loss, list(params.values())))


def test_a_second_finish_names_itself() -> None:
    """finish() twice with no microbatch between: named as such, not as a gradient left from before the window."""
    model = _model()
    acc = MicrobatchAccumulator(model)
    _run(acc, model, _batch(0))
    acc.finish()
    with pytest.raises(WindowError, match=r"still holds the gradient the last finish\(\) handed out"):
        acc.finish()
    acc.discard()


def test_a_backward_outside_microbatch_names_itself() -> None:
    """A backward with no microbatch() around it, then finish(): named as a backward outside microbatch()."""
    model = _model()
    acc = MicrobatchAccumulator(model)
    model(_batch(0)).pow(2).sum().backward()
    with pytest.raises(WindowError, match=r"a backward ran outside microbatch\(\)"):
        acc.finish()
    acc.discard()
    _run(acc, model, _batch(1))  # the accumulator works on after the discard
    acc.finish()


def test_a_gradient_left_by_a_plain_assignment_keeps_the_zeroing_advice() -> None:
    """A non-zero .grad set by hand before the window (neither handed out nor from a backward): the old advice."""
    model = _model()
    acc = MicrobatchAccumulator(model)
    next(model.parameters()).grad = torch.ones_like(next(model.parameters()))
    with pytest.raises(WindowError, match=r"zero the gradients with optimizer.zero_grad\(\)") as caught:
        acc.finish()
    assert "handed out" not in str(caught.value) and "outside microbatch" not in str(caught.value)
    acc.discard()


def test_a_handed_out_gradient_written_in_place_keeps_the_zeroing_advice() -> None:
    """zero_grad(set_to_none=False) and a write into the handed-out tensor: the same object, no longer what finish()
    handed out; and where the version counter cannot be read (stale.version's fallback), the generic advice too."""
    model = _model()
    acc = MicrobatchAccumulator(model)
    _run(acc, model, _batch(0))
    acc.finish()
    model.zero_grad(set_to_none=False)
    next(model.parameters()).grad[0, 0] = 1.0  # type: ignore[index]
    with pytest.raises(WindowError, match="already has a non-zero gradient") as caught:
        acc.finish()
    assert "handed out" not in str(caught.value)
    acc.discard()


def test_without_a_version_counter_the_generic_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradagg.torch.accumulate import stale

    monkeypatch.setattr(stale, "version", lambda t: None)
    model = _model()
    acc = MicrobatchAccumulator(model)
    _run(acc, model, _batch(0))
    acc.finish()
    with pytest.raises(WindowError, match="already has a non-zero gradient yet this rank ran no microbatch"):
        acc.finish()
    acc.discard()
