"""DeepSpeed configs as their users write them (``gradient_accumulation_steps`` k, ``train_batch_size``, a learning-rate
scheduler) under ``exact(engine)``, on every rank of a 2-rank gloo world.

* :func:`sample`: a seeded sample of configurations, k 1 to 4 x ZeRO 1/2/3 x uneven microbatch counts per rank (a
  rank with none, a short last window, a window longer than k), k given or derived by DeepSpeed from
  ``train_batch_size``, weighted or not, a torch or a DeepSpeed-config scheduler, DeepSpeed's reduction averaging
  or summing (``gradient_allreduce_op``); :func:`steps_world` runs each
  case window by window against the float64 one-process truth (the window's count, never k, as the divisor) and
  counts the optimizer's and the scheduler's steps;
* DeepSpeed's own loop (``engine.step()`` after every microbatch) under ``exact``: refused on both ranks at its first
  step; a window of one microbatch per rank declared with ``set_gradient_accumulation_boundary(True)`` is not;
* a total weight whose share per rank (D / world) float32 cannot divide by: refused on both ranks;
* ``"auto"`` in a raw config: what DeepSpeed's ``initialize`` does with it.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

from tests.integrations.workers import deepspeed_zero as dz

WORLD = 2


def sample(seed: int, n: int = 4) -> list[dict[str, Any]]:
    """``n`` seeded cases (n >= 4): every k in 1..4 and every ZeRO stage drawn at least once. Each plan's first window
    has a rank with no microbatch (under ZeRO-3 the other runs exactly one: padded, one each, of which one weighs 0),
    its second a rank with two or more (before such a window, one counted microbatch per rank is DeepSpeed's own
    loop to exact(), refused), and for k > 1 its last is short (fewer than k on every rank)."""
    rng = random.Random(seed)
    ks = rng.sample(range(1, 5), 4) + [rng.randint(1, 4) for _ in range(n - 4)]
    stages = rng.sample(range(1, 4), 3) + [rng.randint(1, 3) for _ in range(n - 3)]
    three = stages.index(3)
    if ks[three] == 1:  # ZeRO-3's padded first window is checked for DeepSpeed's loop only where k > 1
        ks[three], ks[three - 1] = ks[three - 1], ks[three]
    unweighted = next(i for i, s in enumerate(stages) if s != 3)  # ZeRO-3's padding counts in M: weighted there
    # gradient_allreduce_op "sum" (DeepSpeed refuses it under ZeRO-3): one case of ZeRO-1 or -2, weighted
    summed = next(i for i, s in enumerate(stages) if s != 3 and i != unweighted)
    cases = []
    for i, (k, stage) in enumerate(zip(ks, stages, strict=True)):
        plan = [[[rng.randint(0, dz.LENGTH) for _ in range(rng.randint(0, k + 1))] for _ in range(WORLD)]
                for _ in range(3)]
        none = rng.randrange(WORLD)
        plan[0] = [[] if r == none else plan[0][r] or [dz.LENGTH] for r in range(WORLD)]
        if stage == 3:
            plan[0][1 - none] = [rng.randint(1, dz.LENGTH)]
        if max(len(c) for c in plan[1]) < 2:
            plan[1][rng.randrange(WORLD)] += [rng.randint(0, dz.LENGTH) for _ in range(2)]
        if k > 1:  # the short last window
            plan[-1] = [counts[: rng.randint(0, k - 1)] for counts in plan[-1]]
        for window in plan:
            if not any(v for counts in window for v in counts):
                window[rng.randrange(WORLD)].append(dz.LENGTH)
        cases.append({"k": k, "stage": stage, "plan": plan, "derived": i % 2 == 1, "weighted": i != unweighted,
                      "scheduler": "config" if i % 2 == 0 else "torch", "op": "sum" if i == summed else "mean"})
    return cases


def classes(case: dict[str, Any]) -> set[str]:
    """The classes one case reaches."""
    k, plan = case["k"], case["plan"]
    out = {f"k={k}", f"zero-{case['stage']}", "derived k" if case["derived"] else "explicit k",
           "weighted" if case["weighted"] else "unweighted", f"{case['scheduler']} scheduler",
           f"gradient_allreduce_op {case['op']}"}
    if any(not counts for window in plan for counts in window):
        out.add("a rank with no microbatch")
    if k > 1 and any(all(len(c) < k for c in window) for window in plan):
        out.add("a window short of k")
    if any(len(c) > k for window in plan for c in window):
        out.add("a rank with more than k")
    if case["stage"] == 3 and k > 1 and sorted(len(c) for c in plan[0]) == [0, 1]:
        out.add("ZeRO-3 padded to one microbatch each, k > 1")
    return out


def steps_world(cases: list[dict[str, Any]], recipe_stages: list[int]) -> dict[str, Any]:
    """Each case of :func:`sample`; DeepSpeed's loop under ``exact`` per stage in ``recipe_stages``; the divisor and
    ``"auto"`` refusals."""
    dz.no_shared_memory_op()
    return {"cases": [_caught(_case, c) for c in cases], "recipe": {s: _caught(_recipe, s) for s in recipe_stages},
            "tiny_share": _caught(_tiny_share), "auto": _auto()}


def _caught(part: Any, *args: Any) -> dict[str, Any]:
    """``part(*args)``, or what it raised (the same on both ranks here: a refusal), so that the other parts still run
    and the test names it."""
    try:
        out: dict[str, Any] = part(*args)
    except Exception as e:
        return {"raised": f"{type(e).__name__}: {e}"}
    return out


def _engine(stage: int, k: int, derived: bool = False, scheduler: str = "torch", op: str = "mean") -> tuple[Any, Any]:
    """A ZeRO engine as users configure one: ``train_batch_size = micro x k x world`` checked by DeepSpeed (or k
    derived from it), a scheduler that DeepSpeed steps (constant: lr 1 keeps the applied gradient readable), and
    its reduction averaging over the ranks or, ``op`` "sum", summing them (``gradient_allreduce_op``)."""
    import deepspeed

    torch.manual_seed(0)
    model = dz.Tiny()
    # gradient_clipping 0: DeepSpeed's default clips, and a clip that acts would hide a wrong scale
    cfg: dict[str, Any] = {"train_batch_size": k * WORLD, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
                           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                           "steps_per_print": 10**9, "gradient_allreduce_op": op}
    if not derived:
        cfg["gradient_accumulation_steps"] = k
    optimizer = torch.optim.SGD(model.parameters(), lr=dz.LR)
    lr_scheduler = None
    if scheduler == "config":
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": dz.LR, "warmup_max_lr": dz.LR,
                                                            "warmup_num_steps": 1}}
    else:
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=cfg,
                                      dist_init_required=False)
    return engine, engine.lr_scheduler


def _scheduler_steps(scheduler: Any) -> int:
    """How many times DeepSpeed stepped the scheduler: torch's counts from 0, DeepSpeed's WarmupLR from -1."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return int(scheduler.last_epoch)
    return int(scheduler.last_batch_iteration) + 1


def _window(engine: Any, acc: Any, per_rank: list[list[int]], window: int, weighted: bool, pad: bool,
            extra: bool) -> None:
    """One window of gradagg's loop; under ZeRO-3 (``pad``) a rank that ran out pads with weight-0 microbatches;
    ``extra``: the parameter only rank 0's first microbatch of window 0 reaches (see ``deepspeed_zero.uses_extra``)."""
    rank = dist.get_rank()
    mine = per_rank[rank]
    rounds = max(len(c) for c in per_rank) if pad else len(mine)
    for k in range(rounds):
        padding = k >= len(mine)
        tokens, labels = dz.microbatch(window, rank, k, 1 if padding else mine[k])
        with acc.microbatch(weight=(0 if padding else mine[k]) if weighted else None):
            loss = dz.loss_sum(engine, tokens, labels, extra and dz.uses_extra(window, rank, k))
            engine.backward(0 * loss if padding else loss)
    engine.step()


def _error(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], truth: torch.Tensor) -> float:
    applied = torch.cat([(before[n] - after[n]).flatten() for n in before]) / dz.LR
    return float((applied - truth).norm() / truth.norm())


def _case(case: dict[str, Any]) -> dict[str, Any]:
    """One configuration, window by window: the relative error against the truth (the window's tokens as D when
    weighted, its microbatches when not), the divisors, and the optimizer's and scheduler's steps."""
    from gradagg.integrations.deepspeed import exact

    stage, plan, weighted = case["stage"], case["plan"], case["weighted"]
    engine, scheduler = _engine(stage, case["k"], case["derived"], case["scheduler"], case["op"])
    acc = exact(engine)
    errors, divisors = [], []
    for window, per_rank in enumerate(plan):
        before = dz.full(engine)
        truth = dz._truth(before, per_rank, window, 0.0, stage != 3)
        if not weighted:  # _truth divides by the tokens; unweighted, D is the window's microbatches
            truth = truth * sum(v for c in per_rank for v in c) / sum(len(c) for c in per_rank)
        _window(engine, acc, per_rank, window, weighted, pad=stage == 3, extra=stage != 3)
        errors.append(_error(before, dz.full(engine), truth))
        divisors.append(acc.ledger.divisor if acc.ledger else None)
    return {"errors": errors, "divisors": divisors, "k": engine.gradient_accumulation_steps(),
            "global_steps": engine.global_steps, "scheduler_steps": _scheduler_steps(scheduler)}


def _recipe(stage: int) -> dict[str, Any]:
    """DeepSpeed's loop (k = 3) under exact: engine.step() after the first microbatch is refused on both ranks. Then,
    on the same engine, windows of: one microbatch per rank declared a boundary (taken); one per rank, undeclared
    (refused: the declaration held for its own window only); 3 + 1 (taken, and DeepSpeed's loop ruled out); one per
    rank, undeclared (taken)."""
    from gradagg.integrations.deepspeed import exact

    rank = dist.get_rank()
    engine, scheduler = _engine(stage, 3)
    acc = exact(engine)
    out: dict[str, Any] = {}
    tokens, labels = dz.microbatch(0, rank, 0, 4)
    try:
        for _ in range(3):  # DeepSpeed's recipe: backward, step, per microbatch
            with acc.microbatch(weight=4):
                engine.backward(dz.loss_sum(engine, tokens, labels, False))
            engine.step()
        out["refused"] = None
    except Exception as e:  # the test checks the type and the message
        out["refused"] = f"{type(e).__name__}: {e}"
    out["steps_after_refusal"] = [engine.global_steps, _scheduler_steps(scheduler)]
    errors, later = [], []
    for window, per_rank in enumerate([[[5], [3]], [[6], [4]], [[6, 2, 5], [4]], [[2], [3]]]):
        before = dz.full(engine)
        truth = dz._truth(before, per_rank, window, 0.0, False)
        if window == 0:
            engine.set_gradient_accumulation_boundary(True)  # DeepSpeed's public word for "this step ends it"
        try:
            _window(engine, acc, per_rank, window, True, pad=stage == 3, extra=False)
        except Exception as e:
            later.append(f"{type(e).__name__}: {e}")
            continue
        errors.append(_error(before, dz.full(engine), truth))
    out["errors"], out["steps"] = errors, [engine.global_steps, _scheduler_steps(scheduler)]
    out["later_refusals"] = later
    return out


def _tiny_share() -> dict[str, Any]:
    """A total weight D = 2e-38 (float32 can divide by it), whose share per rank D / 2 is below float32's smallest
    normal: refused on both ranks, no step; the next window is exact."""
    from gradagg.integrations.deepspeed import exact

    rank = dist.get_rank()
    engine, scheduler = _engine(1, 1)
    acc = exact(engine)
    tokens, labels = dz.microbatch(0, rank, 0, 4)
    out: dict[str, Any] = {}
    try:
        with acc.microbatch(weight=1e-38):
            engine.backward(dz.loss_sum(engine, tokens, labels, False))
        engine.step()
        out["refused"] = None
    except Exception as e:
        out["refused"] = f"{type(e).__name__}: {e}"
    out["steps_after_refusal"] = [engine.global_steps, _scheduler_steps(scheduler)]
    before = dz.full(engine)
    _window(engine, acc, [[4], [2]], 0, True, pad=False, extra=False)
    out["error_after"] = _error(before, dz.full(engine), dz._truth(before, [[4], [2]], 0, 0.0, False))
    return out


def _auto() -> str | None:
    """``deepspeed.initialize`` on a raw config with ``"gradient_accumulation_steps": "auto"``: what it raises."""
    import deepspeed

    model = dz.Tiny()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": "auto",
           "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=dz.LR), config=cfg,
                             dist_init_required=False)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
