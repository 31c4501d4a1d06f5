"""Worker functions for tests/torch/accumulate/test_lifetime.py: accumulators dropped, several per process, and
the guard's cases that a per-optimizer mark missed, on 2 gloo ranks with uneven microbatch counts.

Every case returns plain values; the test asserts that both ranks decided the same way and, where the loop is
right, that the parameters equal a one-process float64 twin.
"""

from __future__ import annotations

import functools
import gc
import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator, guard
from tests.torch.workers import dist as w

WINDOWS = [[2, 1], [0, 3], [1, 0]]  # microbatches of rank 0 and rank 1, per window
LR, CLIP = 0.5, 0.05  # CLIP below every window's norm here: the clip changes every step


def twin(windows: list[list[int]] = WINDOWS, clip: float | None = CLIP) -> dict[str, torch.Tensor]:
    """The plain loop on one process: each window's mean over all its microbatches, clipped, one SGD step."""
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for k, counts in enumerate(windows):
        batches = w.microbatches(sum(counts), seed=k + 1)
        for b in batches:
            (w.loss_of(model, b) / len(batches)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def error(model: nn.Module, want: dict[str, torch.Tensor]) -> float:
    return max(float((p.detach() - want[n]).abs().max()) for n, p in model.named_parameters())


def run_window(acc: MicrobatchAccumulator, model: nn.Module, k: int, windows: list[list[int]] = WINDOWS) -> None:
    for b in w.my_share(windows[k], dist.get_rank(), seed=k + 1):
        with acc.microbatch():
            w.loss_of(model, b).backward()


# --- dropped accumulators ---------------------------------------------------------------------------------


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    """nanoGPT's shape: the step function builds its own accumulator, which goes out of scope on return."""
    acc = MicrobatchAccumulator(model)
    run_window(acc, model, k)
    acc.finish()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)


def dropped() -> dict[str, Any]:
    """An accumulator per step, never closed: each window is exact, and nothing of the old ones is left."""
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"errors": []}
    for k in range(len(WINDOWS)):
        out["errors"].append(w.error_of(lambda k=k: _train_step(model, opt, k)))
    out["error"] = error(model, twin())
    out["live"] = len(guard._entries)  # no gc.collect(): dropping the last reference must be enough
    # a plain step after the loop: the parameters belong to no accumulator any more, the gradient is not taken
    w.loss_of(model, w.microbatches(1)[0]).backward()
    out["plain_grad"] = model.shared.weight.grad is not None
    out["plain_clip"] = w.error_of(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    gc.collect()
    return out


# --- two accumulators finished in another order on each rank ----------------------------------------------


def orders() -> dict[str, Any]:
    """Two models with the same parameter names, A built before B on every rank; rank 0 finishes A then B,
    rank 1 B then A. Counts [1, 2]: every rank has an open window in both."""
    a, b = w.TinyMoE(), w.TinyMoE()
    acc_a, acc_b = MicrobatchAccumulator(a), MicrobatchAccumulator(b)
    rank = dist.get_rank()
    for model, acc in ((a, acc_a), (b, acc_b)):
        run_window(acc, model, 0, [[1, 2]])
    order = [acc_a, acc_b] if rank == 0 else [acc_b, acc_a]
    out = {"first": w.error_of(order[0].finish), "second": w.error_of(order[1].finish)}
    out["installed"] = any(p.grad is not None for m in (a, b) for p in m.parameters())
    out["step"] = w.error_of(torch.optim.SGD(a.parameters(), lr=0.1).step)  # the refused window is still open
    # finished again in the same order on every rank, before discard(): both windows stay refused
    out["again"] = [w.error_of(acc_a.finish), w.error_of(acc_b.finish)]
    # the same order on every rank afterwards: discard both, and the next window is exact
    acc_a.discard()
    acc_b.discard()
    run_window(acc_a, a, 0, [[1, 2]])
    acc_a.finish()
    out["after"] = w.max_error(w.grads_of(a), w.full_batch_grads(w.microbatches(3)))
    acc_a.close()
    acc_b.close()
    return out


def orders_fuzz(seeds: list[int]) -> list[dict[str, Any]]:
    """Three accumulators of one layout, four windows each, uneven counts (zeros included); in each window every
    rank finishes them in an order drawn from the seed, the same on both ranks about half the time. Per finish:
    the error class (or None) and the gradient's error against the twin when it succeeded; then every window
    still refused is discarded on every rank."""
    rank, out = dist.get_rank(), []
    for seed in seeds:
        rng = random.Random(seed)
        models = [w.TinyMoE() for _ in range(3)]
        accs = [MicrobatchAccumulator(m) for m in models]
        for k in range(4):
            counts = [[rng.randint(0, 2), rng.randint(1, 2)] for _ in models]
            orders = [rng.sample(range(3), 3), rng.sample(range(3), 3)]
            if rng.random() < 0.5:
                orders[1] = orders[0]
            for j, (acc, model) in enumerate(zip(accs, models)):
                model.zero_grad(set_to_none=True)
                run_window(acc, model, 0, [counts[j]])
            for pos, j in enumerate(orders[rank]):
                got = w.error_of(accs[j].finish)
                err = None
                if got is None:
                    want = w.full_batch_grads(w.microbatches(sum(counts[j])))
                    err = w.max_error(w.grads_of(models[j]), want)
                out.append({"seed": seed, "window": k, "pos": pos, "same": orders[0][pos] == orders[1][pos],
                            "error": got, "grad_error": err})
            for acc in accs:
                if acc.state.window.open:
                    acc.discard()
        for acc in accs:
            acc.close()
    return out


# --- the guard's holes --------------------------------------------------------------------------------------


def by_hand() -> dict[str, Any]:
    """No torch.optim: weights updated by hand. The clip before finish() in the second window is refused on
    both ranks (rank 0 ran no microbatch in it); finished, the window is exact."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    out: dict[str, Any] = {}
    for k in range(len(WINDOWS)):
        run_window(acc, model, k)
        out[f"clip{k}"] = w.error_of(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        acc.finish()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
                p.grad = None
    acc.close()
    out["error"] = error(model, twin())
    return out


def after_discard() -> dict[str, Any]:
    """Window 0 finished and stepped; window 1 discarded; window 2's step before finish() is refused."""
    model = w.TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = MicrobatchAccumulator(model)
    run_window(acc, model, 0)
    acc.finish()
    opt.step()
    opt.zero_grad()
    run_window(acc, model, 1)
    acc.discard()
    run_window(acc, model, 2)
    out = {"step": w.error_of(opt.step)}
    acc.close()
    return out


def new_optimizer() -> dict[str, Any]:
    """The optimizer re-created after the first window: its step before finish() in the second is refused."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    run_window(acc, model, 0)
    acc.finish()
    opt.step()
    opt.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    run_window(acc, model, 1)
    out = {"step": w.error_of(opt.step)}
    acc.finish()
    opt.step()
    acc.close()
    return out


def second_attach() -> dict[str, Any]:
    """attach() to a second optimizer over the same parameters while the first is attached: refused at attach()
    (two attached steps would update twice with one window's gradient); after removing the first, exact."""
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    first = torch.optim.SGD(model.parameters(), lr=LR)
    handle = acc.attach(first)
    second = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"attach": w.error_of(lambda: acc.attach(second))}
    handle.remove()
    acc.attach(second)
    for k in range(len(WINDOWS)):
        run_window(acc, model, k)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # attached: finishes first, on both ranks
        second.step()
        second.zero_grad()
    acc.close()
    out["error"] = error(model, twin())
    return out


def guard_fuzz(seeds: list[int]) -> list[dict[str, Any]]:
    """Random programs on 2 ranks, not attached: microbatches (uneven counts, zeros included), clips, steps,
    finishes, discards, optimizers re-created, weights updated by hand. Per clip or step: the error class or None,
    with whether the plan (the same on both ranks) had a window open on some rank."""
    rank, out = dist.get_rank(), []
    for seed in seeds:
        rng = random.Random(seed)
        model = w.TinyMoE()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = MicrobatchAccumulator(model)
        open_any, read, batches = False, False, w.microbatches(4, seed=seed + 1)
        opened = [False, False]  # whose own window is open: the same plan on both ranks
        for step in range(30):
            op = rng.choice(["mbs", "mbs", "clip", "step", "finish", "discard", "new_opt", "hand"])
            if op == "mbs":
                counts = [rng.randint(0, 2), rng.randint(0, 2)]
                if not open_any:
                    model.zero_grad(set_to_none=True)  # a new window starts from no gradient
                for b in batches[: counts[rank]]:
                    with acc.microbatch():
                        w.loss_of(model, b).backward()
                open_any = open_any or sum(counts) > 0
                opened = [o or c > 0 for o, c in zip(opened, counts)]
            elif op in ("clip", "step"):
                got = w.error_of(opt.step if op == "step" else functools.partial(
                    torch.nn.utils.clip_grad_norm_, list(model.parameters()), 1.0))
                out.append({"seed": seed, "step": step, "op": op, "held": open_any, "error": got and got[0]})
            elif op == "finish" and open_any:
                got = w.error_of(acc.finish)  # a window whose held gradients were read is refused on every rank
                out.append({"seed": seed, "step": step, "op": op, "held": read, "error": got and got[0]})
                if read:
                    acc.discard()
                open_any = read = False
                opened = [False, False]
            elif op == "discard":
                acc.discard()
                open_any = read = False
                opened = [False, False]
            elif op == "new_opt":
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            elif op == "hand":  # an update by hand reads the held gradients' placeholders on a rank whose own
                got = w.error_of(functools.partial(update_by_hand, model))  # window is open: refused there, and
                out.append({"seed": seed, "step": step, "op": op, "held": opened[rank], "error": got and got[0]})
                read = read or any(opened)  # the window with it, on every rank
        acc.close()
        out.append({"seed": seed, "params": [p.detach().clone() for p in model.parameters()]})
    return out


def update_by_hand(model: nn.Module) -> None:
    """``p -= lr * p.grad`` over the parameters with a gradient, as a hand-written step does."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad


def lifetime_world() -> dict[str, Any]:
    return {
        "dropped": dropped(),
        "orders": orders(),
        "by_hand": by_hand(),
        "after_discard": after_discard(),
        "new_optimizer": new_optimizer(),
        "second_attach": second_attach(),
    }


__all__ = ["lifetime_world", "twin"]
