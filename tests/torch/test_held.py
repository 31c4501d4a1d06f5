"""gradagg.torch.held: a norm, clip or step over held gradients is refused whatever name it comes by.

The guard (gradagg.torch.guard) replaces torch's clip functions as module attributes; a name taken before the first
accumulator was built escapes it. Between microbatches the held parameters' ``.grad`` is a placeholder that
refuses every read. First the issue's script in a fresh interpreter (the clip imported before gradagg), then a
seeded fuzz over the ways to hold torch's clip, norm and step functions, then 2 gloo ranks (tests/torch/workers/
held_clips.py): a rank with no microbatch reads nothing, and learns of the refusal in finish().
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gradagg.errors import WindowError
from gradagg.testing import launch_local_world, run_local_world
from gradagg.torch import MicrobatchAccumulator, held
from tests.torch.workers import held_clips

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}
# torch's own clip, as a name taken before gradagg replaced the module attribute would hold it
_EARLY_CLIP = torch.nn.utils.clip_grad_norm_
TOL = 1e-12  # float64: the accumulator's mean and the twin's full-batch mean, summed in another order


def test_clip_bound_before_import_is_refused() -> None:
    """The issue's script: clip_grad_norm_ imported before gradagg, called before finish() in a window. It returned
    0.0 and clipped nothing; now it raises WindowError, and finish() refuses the window too."""
    script = textwrap.dedent("""
        import json
        import torch
        from torch.nn.utils import clip_grad_norm_
        clip = torch.nn.utils.clip_grad_norm_
        import gradagg.torch as gt

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).double()
        acc = gt.MicrobatchAccumulator(model)
        for _ in range(3):
            with acc.microbatch():
                model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
        out = {}
        for name, f in (("from_import", clip_grad_norm_), ("alias", clip)):
            try:
                out[name] = float(f(model.parameters(), 0.1))
            except Exception as exc:
                out[name] = [type(exc).__name__, str(exc)]
        try:
            acc.finish()
            grads = [p.grad.flatten() for p in model.parameters()]
            out["norm_after"] = float(torch.linalg.vector_norm(torch.cat(grads)))
        except Exception as exc:
            out["finish"] = [type(exc).__name__, str(exc)]
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}  # this checkout's gradagg
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("from_import", "alias"):
        assert isinstance(out[name], list) and out[name][0] == "WindowError", out
        assert "read the gradient of parameter" in out[name][1] and "acc.finish()" in out[name][1], out
    assert "finish" in out and "held gradient read before finish()" in out["finish"][1], out


# --- the fuzz: every way to hold torch's clip, norm and step functions -------------------------------------------

ORIGINAL = {  # what a name taken before the first accumulator holds (this process may have wrappers installed)
    name: getattr(getattr(torch.nn.utils, name), "__gradagg_original__", getattr(torch.nn.utils, name))
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")
}
MAX, VALUE, LR = 0.05, 0.01, 0.5  # below the gradients' norm and largest entry: the clips change them
Params = list[torch.nn.Parameter]


def _grads(params: Params) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _total_then_clip(params: Params) -> torch.Tensor:  # torchtitan's and Accelerate's order
    total = torch.nn.utils.get_total_norm(_grads(params))
    ORIGINAL["clip_grads_with_norm_"](params, MAX, total)
    return total


def _foreach_norm(params: Params) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(_grads(params))))


def _norm_by_hand(params: Params) -> torch.Tensor:
    return sum((g.double() ** 2).sum() for g in _grads(params)) ** 0.5  # type: ignore[no-any-return]


def _update_by_hand(params: Params) -> None:
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= LR * p.grad


HOLDS: dict[str, tuple[str, Callable[[Params, Any], Any]]] = {
    # name: (class, call(params, optimizer)); each a way a user's script holds the function
    "clip_norm from-import": ("clip", lambda ps, o: ORIGINAL["clip_grad_norm_"](ps, MAX)),
    "clip_norm attribute": ("clip", lambda ps, o: torch.nn.utils.clip_grad_norm_(ps, MAX)),
    "clip_norm clip_grad module": ("clip", lambda ps, o: torch.nn.utils.clip_grad.clip_grad_norm_(ps, MAX)),
    "clip_norm partial": ("clip", lambda ps, o: functools.partial(ORIGINAL["clip_grad_norm_"], max_norm=MAX)(ps)),
    "clip_norm dict": ("clip", lambda ps, o: {"clip": ORIGINAL["clip_grad_norm_"]}["clip"](ps, MAX)),
    "clip_value from-import": ("clip", lambda ps, o: ORIGINAL["clip_grad_value_"](ps, VALUE)),
    "get_total_norm + clip_grads_with_norm_": ("norm", lambda ps, o: _total_then_clip(ps)),
    "_foreach_norm by hand": ("norm", lambda ps, o: _foreach_norm(ps)),
    "p.grad norms by hand": ("norm", lambda ps, o: _norm_by_hand(ps)),
    "step bound before": ("step", lambda ps, o: o.bound_step()),
    "step through the class": ("step", lambda ps, o: type(o).step(o)),
    "step partial": ("step", lambda ps, o: functools.partial(o.step)()),
    "update by hand": ("step", lambda ps, o: _update_by_hand(ps)),
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()


def _batches(seed: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 2, generator=g, dtype=torch.float64))
            for _ in range(m)]


def _loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (model(b[0]) - b[1]).pow(2).sum()


def _optimizer(model: torch.nn.Module, kind: str) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=LR) if kind == "sgd" else torch.optim.Adam(model.parameters(), lr=LR)
    opt.bound_step = opt.step  # a bound method taken before any accumulator: the global step hooks still run
    return opt


def _result(value: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    out = [] if value is None else [torch.as_tensor(value, dtype=torch.float64).detach().reshape(-1)]
    out += [p.detach().clone() for p in model.parameters()]
    return out + [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _one(seed: int, hold: str, when: str, kind: str) -> str:
    """One draw; returns the outcome (``refused`` or ``exact``), asserting what it must be."""
    what, call = HOLDS[hold]
    model, twin = _model(seed), _model(seed)
    opt, twin_opt = _optimizer(model, kind), _optimizer(twin, kind)
    batches = _batches(seed, 1 + seed % 3)
    acc = MicrobatchAccumulator(model)
    for b in batches:
        with acc.microbatch():
            _loss(model, b).backward()
        (_loss(twin, b) / len(batches)).backward()
    params = list(model.parameters())
    try:
        if when == "finished":
            acc.finish()
            got = _result(call(params, opt), model)
            want = _result(call(list(twin.parameters()), twin_opt), twin)
            assert len(got) == len(want) and all(float((a - b).abs().max()) <= TOL for a, b in zip(got, want)), hold
            return "exact"
        before = [p.detach().clone() for p in params]
        with pytest.raises(WindowError, match=r"finish\(\)"):
            call(params, opt)
        assert all(torch.equal(a, p) for a, p in zip(before, params)), f"{hold}: changed the weights"
        try:  # refused by a replaced function or a step hook (nothing read): the window finishes, exact
            acc.finish()
        except WindowError as exc:  # refused by the placeholder: the window is refused too
            assert "held gradient read before finish()" in str(exc), (hold, str(exc))
            return "refused, window refused"
        assert all(float((p.grad - q.grad).abs().max()) <= TOL for p, q in zip(params, twin.parameters())), hold
        return "refused, window kept"
    finally:
        acc.close()


@pytest.mark.parametrize("seed", range(3))
def test_every_way_to_hold_clip_norm_step(seed: int) -> None:
    """Seeded draws of every (way to hold the function, window open or finished), shuffled, with SGD or Adam and
    1 to 3 microbatches drawn: inside an open window
    every one raises WindowError naming finish() and changes nothing; after finish() every one computes what it
    computes on a plain float64 twin holding the full batch's mean gradient. Each way and each outcome is counted
    and must be reached."""
    rng = random.Random(seed)
    reached: collections.Counter[tuple[str, str]] = collections.Counter()
    draws = [(hold, when) for hold in sorted(HOLDS) for when in ("open", "finished")]
    rng.shuffle(draws)
    for k, (hold, when) in enumerate(draws):
        reached[(HOLDS[hold][0], _one(1000 * seed + k, hold, when, rng.choice(["sgd", "adam"])))] += 1
        reached[(hold, when)] += 1
    print(dict(reached))
    assert all(reached[(h, "open")] for h in HOLDS), reached
    for what in ("clip", "norm", "step"):
        assert reached[(what, "refused, window refused")] and reached[(what, "exact")], (what, reached)
    assert reached[("clip", "refused, window kept")] and reached[("step", "refused, window kept")], reached


# --- what the placeholder lets through, and where it is not --------------------------------------------------


def _open_window(model: torch.nn.Module, acc: MicrobatchAccumulator, m: int = 2) -> None:
    for b in _batches(7, m):
        with acc.microbatch():
            _loss(model, b).backward()


def test_placeholder_between_microbatches_only() -> None:
    """The placeholder is in .grad between microbatches, None inside one, gone after finish(), discard() and
    close(); zero_grad(set_to_none=False) leaves the window as it is; it prints as what it is."""
    model = _model(1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = MicrobatchAccumulator(model)
    _open_window(model, acc)
    assert all(held.is_held(p.grad) for p in model.parameters()) and "HeldGradient" in repr(model[0].weight.grad)
    with acc.microbatch():
        assert all(p.grad is None for p in model.parameters())
        _loss(model, _batches(8, 1)[0]).backward()
    opt.zero_grad(set_to_none=False)  # no gradient to zero in a window, as before
    torch._foreach_zero_([p.grad for p in model.parameters()])
    assert acc.finish().microbatches_global == 3 and not any(held.is_held(p.grad) for p in model.parameters())
    opt.zero_grad()
    _open_window(model, acc)
    acc.discard()
    assert all(p.grad is None for p in model.parameters())
    _open_window(model, acc)
    acc.close()
    assert all(p.grad is None for p in model.parameters())
    acc = MicrobatchAccumulator(model)
    _open_window(model, acc)
    del acc
    gc.collect()
    assert all(p.grad is None for p in model.parameters())  # dropped mid-window: no placeholder outlives it


def test_inside_a_microbatch_an_early_clip_is_refused_after_its_backward() -> None:
    """Inside ``microbatch()``, once a backward took the gradients, a clip by a name taken before gradagg (bound
    early, so the guard's replaced function is not the one called) is refused and fails the window: it read
    None there and returned 0 before."""
    clip = _EARLY_CLIP
    model = _model(3)
    acc = MicrobatchAccumulator(model)
    _open_window(model, acc)
    with pytest.raises(WindowError, match="still holds"):
        with acc.microbatch():
            _loss(model, _batches(10, 1)[0]).backward()
            clip(model.parameters(), 0.1)
    with pytest.raises(WindowError, match="read the gradient"):
        acc.finish()
    acc.close()


def test_several_backwards_in_one_microbatch_still_sum() -> None:
    """Two backwards in one microbatch (the placeholder in .grad between them, lifted before autograd accumulates)
    count as that microbatch's gradient: the same as one backward of the summed loss."""
    batches = _batches(11, 3)
    model, twin = _model(4), _model(4)
    acc, acc_twin = MicrobatchAccumulator(model), MicrobatchAccumulator(twin)
    for b, c in zip(batches, batches[1:] + batches[:1]):
        with acc.microbatch(weight=2):
            _loss(model, b).backward()
            assert all(held.is_held(p.grad) for p in model.parameters())
            _loss(model, c).backward()
        with acc_twin.microbatch(weight=2):
            (_loss(twin, b) + _loss(twin, c)).backward()
    acc.finish()
    acc_twin.finish()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert float((p.grad - q.grad).abs().max()) <= TOL  # type: ignore[operator]
    acc.close()
    acc_twin.close()


def test_writes_into_the_placeholder_fail_the_window() -> None:
    """A backward outside microbatch() and ``p.grad += g`` by hand between microbatches add into the placeholder:
    the window fails as for a gradient outside a microbatch."""
    for how in ("backward", "by hand"):
        model = _model(2)
        acc = MicrobatchAccumulator(model)
        _open_window(model, acc)
        if how == "backward":
            _loss(model, _batches(9, 1)[0]).backward()
        else:
            with torch.no_grad():
                model[0].bias.grad += 1.0
        with pytest.raises(WindowError, match="outside microbatch"):
            acc.finish()
        acc.close()


def test_without_placeholders_the_replaced_functions_still_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where torch lacks ``_make_wrapper_subclass``: no placeholder; a clip through torch.nn.utils is
    still refused (the guard's wrappers), a name held from before still reads None and clips nothing."""
    monkeypatch.setattr(held, "AVAILABLE", False)
    model = _model(3)
    acc = MicrobatchAccumulator(model)
    _open_window(model, acc)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(WindowError, match="acc.finish"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX)
    assert float(ORIGINAL["clip_grad_norm_"](model.parameters(), MAX)) == 0.0  # the hole the placeholder closes
    acc.close()


def test_two_ranks_early_clip() -> None:
    """2 gloo ranks, a clip imported before any accumulator: counts [2, 0] (rank 1 reads nothing) then [1, 2]: the
    clip raises on every rank that holds gradients and finish() refuses on both ranks; after finish() the clip
    and step equal the twin's. A rank 0 that stops at the error leaves rank 1 a CollectiveError in finish()."""
    for r in run_local_world(held_clips.early_clip_world, 2, **WORLD):
        rank = r["rank"]
        for k, counts in enumerate(held_clips.WINDOWS[:2]):
            clip, finish = r[f"clip{k}"], r[f"finish{k}"]
            if counts[rank]:
                assert clip[0] == "WindowError" and "read the gradient" in clip[1], r
            else:
                assert clip == ["value", 0.0], r  # nothing held here: .grad None reads as no gradient
            assert finish is not None and finish[0] == "WindowError" and "held gradient read" in finish[1], r
        assert r["norm_error"] <= TOL and r["error"] <= TOL, r
    outcomes = launch_local_world(held_clips.early_clip_stops, 2, **WORLD)
    assert not outcomes[0].ok and "WindowError" in str(outcomes[0].error), outcomes[0]
    assert not outcomes[1].ok and "CollectiveError" in str(outcomes[1].error), outcomes[1]
