"""gradagg.torch.guard: no clip or optimizer step silently misses the gradients an accumulator still holds.

One process first (the window open is what is held), then 2 gloo ranks where one rank runs no microbatch
in each window and must decide as the other does (see tests/torch/workers/clips.py).
"""

from __future__ import annotations

import gc
import random
from typing import Any

import pytest
import torch

from gradagg.errors import WindowError
from gradagg.testing import run_local_world
from gradagg.torch import MicrobatchAccumulator, guard
from tests.torch.workers import clips
from tests.torch.workers import dist as w

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}
# a name for the clip taken before any accumulator was built (where one was, the guard's wrapper: what it wraps)
EARLY_CLIP = getattr(torch.nn.utils.clip_grad_norm_, "__gradagg_original__", torch.nn.utils.clip_grad_norm_)
TOL = 1e-12  # float64, two windows of <= 3 microbatch means summed in another order than the twin's


def one_window(model: torch.nn.Module, acc: MicrobatchAccumulator, n: int = 2) -> None:
    for b in w.microbatches(n):
        with acc.microbatch():
            w.loss_of(model, b).backward()


def test_clip_before_finish_is_refused() -> None:
    """Not attached: clip_grad_norm_, clip_grad_value_ and clip_grads_with_norm_ inside an open window raise,
    naming the clip and finish(); after finish() the clip sees the gradient."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    one_window(model, acc)
    for clip in (
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1.0),
        lambda: torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 1.0, torch.tensor(1.0)),
    ):
        with pytest.raises(WindowError, match=r"torch\.nn\.utils\.clip_grad.*acc\.finish\(\) before clipping"):
            clip()
    acc.finish()
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) > 0
    acc.close()


def test_step_before_finish_is_refused() -> None:
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = MicrobatchAccumulator(model)
    one_window(model, acc)
    with pytest.raises(WindowError, match=r"SGD\.step\(\) would skip .* acc\.finish\(\) before optimizer\.step\(\)"):
        opt.step()
    acc.finish()
    opt.step()
    acc.close()


def test_attached_clip_finishes_first() -> None:
    """Attached: the clip finishes the window, then clips the exact mean (its norm is the twin's); the step
    does not finish again (it would find M = 0 and raise)."""
    model, twin = w.TinyMoE(), w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = MicrobatchAccumulator(model)
    acc.attach(opt)
    one_window(model, acc, 3)
    for b in w.microbatches(3):
        (w.loss_of(twin, b) / 3).backward()
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    assert abs(float(got - want)) <= TOL and acc.ledger.microbatches_global == 3
    opt.step()
    assert w.max_error(w.grads_of(model), w.grads_of(twin)) <= TOL
    acc.close()


def test_accelerate_clip_grad_norm(accelerator: Any) -> None:
    """Accelerate's (and HF Trainer's) accelerator.clip_grad_norm_ reaches torch.nn.utils.clip_grad_norm_
    with a list: the attached accumulator finishes first."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = w.TinyMoE()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False)
    acc = MicrobatchAccumulator(model)
    acc.attach(opt)
    one_window(model, acc)
    assert float(accelerator.clip_grad_norm_(model.parameters(), 1e9)) > 0
    assert acc.ledger.microbatches_global == 2
    acc.close()


def test_unrelated_parameters_pass_through() -> None:
    """A clip or a step over parameters no accumulator holds is not touched, window open or not."""
    model, other = w.TinyMoE(), torch.nn.Linear(2, 1)
    acc = MicrobatchAccumulator(model)
    one_window(model, acc)
    other(torch.ones(1, 2)).sum().backward()
    assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9)) > 0
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    acc.discard()
    acc.close()


def test_originals_back_when_no_accumulator_lives() -> None:
    gc.collect()
    before = dict(vars(torch.nn.utils))
    acc = MicrobatchAccumulator(torch.nn.Linear(1, 1))
    assert torch.nn.utils.clip_grad_norm_ is guard.guarded_functions()["clip_grad_norm_"]
    for name in ("unscale_", "step"):  # GradScaler's: a reader of the gradients, and the step it may skip
        assert getattr(torch.amp.GradScaler, name) is guard.guarded_functions()[f"GradScaler.{name}"]
    acc.close()
    del acc
    gc.collect()
    if not guard._entries:  # another test's accumulator may still be alive: then the wrappers stay, harmless
        assert {k: vars(torch.nn.utils)[k] for k in before} == before or not guard.guarded_functions()
        assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"
        assert not any(hasattr(getattr(torch.amp.GradScaler, n), "__gradagg_original__") for n in ("unscale_", "step"))


@pytest.mark.parametrize("seed", range(6))
def test_random_programs(seed: int) -> None:
    """Random loops of microbatch / clip / step / finish, attached or not: a clip or step while the window is
    open raises (not attached) or sees the finished window (attached: the clip's norm is not 0); nothing else
    raises, but an attached step with no microbatch since the last one. The wrong fix "let the clip
    through" would fail the norm check. A clip by a name taken before any accumulator ("early") raises while
    the window is open, attached or not (the placeholder refuses it), and the window is then discarded."""
    rng = random.Random(seed)
    attached = seed % 2 == 1
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    acc = MicrobatchAccumulator(model)
    if attached:
        acc.attach(opt)
    batches = w.microbatches(8, seed=seed + 1)
    reached, kinds = set(), {(op, o) for op in ("clip", "step", "early") for o in (True, False)}
    for k in range(200):  # 40 draws, then on until every kind was drawn, window open and not
        if k >= 40 and kinds <= reached:
            break
        op = rng.choice(["mb", "mb", "clip", "step", "finish", "early"])
        open_ = acc.state.window.open
        reached.add((op, open_))
        try:
            if op == "mb":
                if not open_:
                    opt.zero_grad()  # a new window starts from no gradient, as in every loop
                with acc.microbatch():
                    w.loss_of(model, rng.choice(batches)).backward()
            elif op == "clip":
                norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
                assert not open_ or (norm > 0 and not acc.state.window.open), f"seed {seed}: clip saw nothing"
            elif op == "step":
                opt.step()
            elif op == "early":
                norm = float(EARLY_CLIP(model.parameters(), 1e9))
                assert not open_ and (norm > 0) == any(p.grad is not None for p in model.parameters()), seed
            elif open_:
                acc.finish()
        except WindowError as exc:
            if op == "early":  # the window is refused with the read: start afresh
                assert open_ and "read the gradient" in str(exc), f"seed {seed}: {exc}"
                acc.discard()
                continue
            refused = open_ and not attached and op in ("clip", "step")
            # attached, a second step with no microbatch between: it finishes an empty window (M = 0, or the
            # last step's gradients still there): the loop's own mistake, refused on every rank; start afresh
            empty = attached and op == "step" and not open_
            assert refused or empty, f"seed {seed}: {op}: {exc}"
            if empty:
                acc.discard()
    acc.close()
    assert kinds <= reached, (seed, kinds - reached)


def test_two_ranks() -> None:
    """Windows of counts [2, 0] then [0, 3]: attached, the clip finishes on both ranks and the steps equal the
    twin's clipped ones; not attached, every clip and step before finish() raises on both ranks, the rank with
    no microbatch included, and a step after the window's step (nothing held anywhere) passes; torchtitan's
    clip (its norm reads the held gradients' placeholders) raises on both, and the step is refused until
    discard(); the originals are back at the end."""
    for r in run_local_world(clips.guard_world, 2, **WORLD):
        assert r["attached"]["error"] <= TOL and r["attached"]["norm_error"] <= TOL
        na = r["not_attached"]
        for key in ("clip0", "step0", "clip1", "step1"):
            assert na[key] is not None and na[key][0] == "WindowError", (key, na[key])
        # nothing held on any rank (both windows finished, .grad None): a second step passes, as in one process
        assert na["step_again"] is None
        assert na["error"] <= TOL
        tt = r["torchtitan"]
        if not tt.get("skipped"):
            assert tt["raised"] is not None and "read the gradient of parameter" in tt["raised"][1], tt
            assert tt["step"] is not None and "discard()" in tt["step"][1], tt
            assert tt["divisor"] == 3
        assert r["restored"]
