"""An accumulator's lifetime and identity (issue 22): dropped ones release everything, two live ones over one
parameter are refused, the ranks agree on which accumulator a window's collective belongs to, and the guard
refuses on every rank what a per-optimizer mark missed (hand updates, a discard, a new or second optimizer).

One process first, then 2 gloo ranks with uneven microbatch counts (see tests/torch/workers/lifetime.py).
"""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import pytest
import torch

from gradagg.errors import GradaggError
from gradagg.testing import run_local_world
from gradagg.torch import MicrobatchAccumulator, guard
from tests.torch.workers import dist as w
from tests.torch.workers import lifetime

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 180.0, "preload": ["torch._dynamo"]}
TOL = 1e-12  # float64: <= 3 windows of <= 3 microbatch means, summed in another order than the twin's


def _built_and_dropped(model: torch.nn.Module) -> weakref.ReferenceType[Any]:
    acc = MicrobatchAccumulator(model)
    with acc.microbatch():
        w.loss_of(model, w.microbatches(1)[0]).backward()
    acc.finish()
    return weakref.ref(acc.state)


def test_a_dropped_accumulator_is_released() -> None:
    """Dropped without close(): its state is freed on the last reference (no gc.collect()), its hooks and its
    guard entry go with it, and a plain backward afterwards leaves its gradient in .grad."""
    model = w.TinyMoE()
    state = _built_and_dropped(model)
    assert state() is None
    assert not any(s() is not None and any(t is model.shared.weight for t in s().tensors)  # type: ignore[union-attr]
                   for s in (e.state for e in guard._entries.values()))
    model.zero_grad(set_to_none=True)
    w.loss_of(model, w.microbatches(1)[0]).backward()
    assert model.shared.weight.grad is not None


def test_an_attached_dropped_accumulator_is_released() -> None:
    """attach() keeps no reference to the accumulator: dropped, the optimizer's step is plain again."""
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = MicrobatchAccumulator(model)
    acc.attach(opt)
    state = weakref.ref(acc.state)
    del acc
    assert state() is None
    w.loss_of(model, w.microbatches(1)[0]).backward()
    before = model.shared.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.shared.weight)


def test_two_live_accumulators_over_one_parameter_are_refused() -> None:
    """Nested with-blocks of two accumulators over one model: the second is refused at construction, naming
    both (it used to finish with zero gradients while its ledger said the parameters were used)."""
    model = w.TinyMoE()
    first = MicrobatchAccumulator(model)
    both = r"accumulator #\d+ \(built at test_lifetime\.py:\d+.*built at test_lifetime\.py:\d+"
    with first.microbatch(), pytest.raises(GradaggError, match=both) as info:
        MicrobatchAccumulator(model.experts)
    assert "'0.weight'" in str(info.value) and "'experts.0.weight'" in str(info.value)
    first.discard()
    first.close()
    MicrobatchAccumulator(model).close()  # closed, the first no longer counts


def test_overlap_of_bare_tensors_is_refused() -> None:
    a = torch.zeros(2, requires_grad=True)
    acc = MicrobatchAccumulator([("a", a)])
    with acc.microbatch(), pytest.raises(GradaggError, match="already accumulated"):
        MicrobatchAccumulator([("b", torch.zeros(1, requires_grad=True)), ("a2", a)])
    acc.discard()
    acc.close()


def test_an_accumulator_per_step_at_the_top_level() -> None:
    """`acc = MicrobatchAccumulator(model)` at the top of every step of a loop: the previous one, still named by
    `acc` while the new one is built but holding no window, is closed by it (its later use refused, naming why),
    and every window is the plain mean of its microbatches (the second step used to be refused)."""
    model = w.TinyMoE()
    batches = w.microbatches(4, seed=3)
    old = None
    for step in range(3):
        acc = MicrobatchAccumulator(model)
        if old is not None:
            with pytest.raises(GradaggError, match="closed.*newer accumulator"):
                old.microbatch().__enter__()
        model.zero_grad(set_to_none=True)
        chosen = batches[step:step + 2]
        for b in chosen:
            with acc.microbatch():
                w.loss_of(model, b).backward()
        acc.finish()
        names = {n for n, _ in model.named_parameters()}
        assert w.max_error(w.grads_of(model), _mean_grads(chosen, names)) <= TOL, step
        old = acc
    acc.close()


@pytest.mark.parametrize("seed", range(8))
def test_accumulators_dropped_nested_and_several(seed: int) -> None:
    """Random programs over three models (two sharing the same parameter names): accumulators built, dropped,
    closed, opened and used in any order. Oracle: construction is refused iff a live accumulator holds one of the
    parameters with a window open; a live one holding no window is closed by the new one (its use then refused);
    every finished window is the plain mean of its microbatches; a clip over a model that no live accumulator
    holds with an open window passes."""
    print(f"seed {seed}")
    rng = random.Random(seed)
    models = [w.TinyMoE() for _ in range(3)]
    live: dict[int, MicrobatchAccumulator] = {}
    opened: dict[int, list[w.Batch]] = {}  # model -> the microbatches of its accumulator's open window
    batches = w.microbatches(6, seed=seed + 1)
    for step in range(30):
        k = rng.randrange(3)
        op = rng.choice(["build", "build", "drop", "close", "window", "window", "clip", "open"])
        where = f"seed {seed} step {step} {op} model {k}"
        if op == "build":
            part = models[k] if rng.random() < 0.7 else models[k].experts
            refused = k in opened
            try:
                built = MicrobatchAccumulator(part)
            except GradaggError as exc:
                assert refused, f"{where}: {exc}"
                continue
            assert not refused, f"{where}: built over a model held with a window open"
            if k in live:
                old = live.pop(k)
                with pytest.raises(GradaggError, match="closed by a newer accumulator"):
                    old.finish()
                del old
            live[k], built = built, None  # type: ignore[assignment]  # only `live` may hold it: drops are checked
        elif op == "open" and k in live and k not in opened:
            models[k].zero_grad(set_to_none=True)
            with live[k].microbatch():
                w.loss_of(models[k], batches[0]).backward()
            opened[k] = [batches[0]]
        elif op == "drop" and k in live:
            opened.pop(k, None)
            ref = weakref.ref(live.pop(k).state)
            assert ref() is None, where
        elif op == "close" and k in live:
            if k in opened:
                live[k].discard()
                del opened[k]
            live.pop(k).close()
        elif op == "window" and k in live:
            model = models[k]
            new = rng.sample(batches, rng.randint(1, 3))
            if k not in opened:
                model.zero_grad(set_to_none=True)
            chosen = opened.pop(k, []) + new
            for b in new:
                with live[k].microbatch():
                    w.loss_of(model, b).backward()
            live[k].finish()
            mine = {n for n, p in model.named_parameters() if any(p is t for t in live[k].state.tensors)}
            got = {n: g for n, g in w.grads_of(model).items() if n in mine}
            want = _mean_grads(chosen, mine)
            assert w.max_error(got, want) <= TOL, where
        elif op == "clip" and k in opened:
            with pytest.raises(GradaggError, match="clip"):
                torch.nn.utils.clip_grad_norm_(models[k].parameters(), 1.0)  # a window open: refused
        elif op == "clip":
            models[k].zero_grad(set_to_none=True)
            torch.nn.utils.clip_grad_norm_(models[k].parameters(), 1.0)  # no window open: passes
    for k, left in live.items():
        if k in opened:
            left.discard()
        left.close()
    gc.collect()


def _mean_grads(batches: list[w.Batch], names: set[str]) -> w.Grads:
    twin = w.TinyMoE()
    for b in batches:
        (w.loss_of(twin, b) / len(batches)).backward()
    return {n: g for n, g in w.grads_of(twin).items() if n in names}


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_local_world(lifetime.lifetime_world, 2, **WORLD)


def test_an_accumulator_per_step_in_a_helper(world: list[dict[str, Any]]) -> None:
    """nanoGPT's loop on 2 uneven ranks, the accumulator built inside the step function: every window works
    (the second's clip was refused, the first accumulator still holding the gradients) and equals the twin."""
    for r in world:
        d = r["dropped"]
        assert d["errors"] == [None] * len(lifetime.WINDOWS), d["errors"]
        assert d["error"] <= TOL
        assert d["live"] == 0 and d["plain_grad"] and d["plain_clip"] is None


def test_two_accumulators_finished_in_another_order(world: list[dict[str, Any]]) -> None:
    """Rank 0 finishes A then B, rank 1 B then A: both finishes refused on both ranks, naming each rank's
    accumulator, nothing installed (the gradients were mixed, silently); finished again in one order before
    discard(), still refused; discarded, the next window is exact."""
    for r in world:
        o = r["orders"]
        for key in ("first", "second"):
            assert o[key] is not None and o[key][0] in ("CollectiveError", "WindowError"), (key, o[key])
            assert "accumulator #" in o[key][1] and "another order" in o[key][1], o[key][1]
            if o[key][0] == "WindowError":
                assert "rank 0: accumulator #" in o[key][1] and "; rank 1: accumulator #" in o[key][1], o[key][1]
        assert not o["installed"]
        assert o["step"] is not None and o["step"][0] == "WindowError", o["step"]  # a step on no gradient refused
        for again in o["again"]:  # finished again before discard(): still refused
            assert again is not None and again[0] == "WindowError", again
            assert "refused an earlier finish() of this window" in again[1], again
            assert "(here: the ranks finished different accumulators in one collective)" in again[1], again
        assert o["after"] <= TOL


def test_guard_holes_refused_on_both_ranks(world: list[dict[str, Any]]) -> None:
    """The clip before finish() with weights updated by hand, the step before finish() after a discard() or with
    an optimizer re-created: refused on both ranks (the rank with no microbatch included) in every window."""
    for r in world:
        h = r["by_hand"]
        for k in range(len(lifetime.WINDOWS)):
            assert h[f"clip{k}"] is not None and h[f"clip{k}"][0] == "WindowError", (k, h[f"clip{k}"])
        assert h["error"] <= TOL
        for case in ("after_discard", "new_optimizer"):
            got = r[case]["step"]
            assert got is not None and got[0] == "WindowError" and "acc.finish()" in got[1], (case, got)


def test_a_second_attached_optimizer_is_refused(world: list[dict[str, Any]]) -> None:
    for r in world:
        s = r["second_attach"]
        assert s["attach"] is not None and s["attach"][0] == "GradaggError" and "already attached" in s["attach"][1]
        assert s["error"] <= TOL


def test_finish_orders_fuzz() -> None:
    """Class test of the reordered finish: three accumulators of one layout, four windows, uneven counts, finish
    orders drawn per rank (seeded). A finish at a position where both ranks finish the same accumulator is exact;
    one where they differ refuses on both ranks, naming the other order."""
    seeds = list(range(4))
    print(f"seeds {seeds}")
    ranks = run_local_world(lifetime.orders_fuzz, 2, seeds, **WORLD)
    assert len(ranks[0]) == len(ranks[1]) == 4 * 4 * 3
    assert {r["same"] for r in ranks[0]} == {True, False}  # both kinds drawn
    for r0, r1 in zip(*ranks):
        where = (r0["seed"], r0["window"], r0["pos"])
        assert r0["same"] == r1["same"], where
        for r in (r0, r1):
            if r["same"]:
                assert r["error"] is None and r["grad_error"] <= TOL, (where, r)
            else:
                assert r["error"] is not None and "another order" in r["error"][1], (where, r)


def test_guard_programs_fuzz() -> None:
    """Class test of the guard's holes: random programs on 2 ranks (hand updates, discards, re-created optimizers,
    uneven counts with zeros). A clip or step is refused on both ranks exactly when a window is open on some
    rank; an update by hand exactly on a rank whose own window is open (it reads the held gradients'
    placeholders), and the window's finish() then on both; both ranks end with the same parameters."""
    seeds = list(range(5))
    print(f"seeds {seeds}")
    ranks = run_local_world(lifetime.guard_fuzz, 2, seeds, **WORLD)
    assert len(ranks[0]) == len(ranks[1])
    seen = set()
    for r0, r1 in zip(*ranks):
        if "params" in r0:
            assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"])), r0["seed"]
            continue
        for r in (r0, r1):
            want = "WindowError" if r["held"] else None
            assert r["error"] == want, (r0["seed"], r0["step"], r0["op"], r)
        seen.add((r0["op"], r0["held"]))
    kinds = {(op, held) for op in ("clip", "step", "hand") for held in (True, False)} | {("finish", True)}
    assert kinds <= seen, kinds - seen  # every kind drawn
