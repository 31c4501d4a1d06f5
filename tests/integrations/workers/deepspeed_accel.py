"""Accelerate with its DeepSpeed plugin on every rank of a 2-rank gloo world, with a DeepSpeedAccumulator on its engine.

Accelerate 1.15's DeepSpeed backward sets the engine's accumulation boundary from ``sync_gradients``, calls
``engine.backward(loss)`` (which divides by ``gradient_accumulation_steps``) and, on the sync microbatch,
``engine.step()`` inside the backward: the accumulator's wrapped backward never divides and its wrapped step closes
the window there. 10 sequences, 5 per rank from Accelerate's prepared DataLoader: a window of 3, the short one of 2.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.integrations.workers import deepspeed_zero as dz

STEPS, SEQUENCES = 3, 10
VALID = [6, 2, 5, 3, 1, 4, 6, 2, 3, 5]  # valid tokens of each global sequence


def accelerate_world(stage: int, loops: list[str]) -> dict[str, Any]:
    """Each loop: "exact" (accelerator.backward(loss_sum) in acc.microbatch(weight=tokens)), "line" (the same with
    the accumulator from the one line users call, gradagg.integrations.accelerate.exact) or "native"
    (Accelerate's documented recipe with the mean loss): its per-step relative errors and step count. One ZeRO
    stage per Accelerate state: Accelerate takes a DeepSpeed plugin at its first Accelerator only, so the state is
    reset first (Accelerate's private ``_reset_state``, as :func:`deepspeed_hf._deepspeed_state` does; test-only)."""
    from accelerate.state import AcceleratorState

    dz.launcher()
    AcceleratorState._reset_state(reset_partial_state=True)
    return {loop: _case(stage, loop, first=k == 0) for k, loop in enumerate(loops)}


def _case(stage: int, loop: str, first: bool) -> dict[str, Any]:
    from accelerate import Accelerator, DeepSpeedPlugin

    from gradagg.integrations import accelerate as integration
    from gradagg.integrations.deepspeed import DeepSpeedAccumulator

    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": STEPS, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
    accelerator = Accelerator(deepspeed_plugin=plugin if first else None, gradient_accumulation_steps=STEPS)
    torch.manual_seed(0)
    model = dz.Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=dz.LR)
    loader: Any = torch.utils.data.DataLoader(list(range(SEQUENCES)), batch_size=1)  # type: ignore[arg-type]
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    acc = {"exact": DeepSpeedAccumulator, "line": lambda e: integration.exact(accelerator, e, optimizer)}.get(
        loop, lambda e: None)(engine)
    errors, windows, seen, before = [], [], [], dz.full(engine)
    for (i,) in loader:
        seen.append(int(i))
        tokens, labels = dz.microbatch(0, 0, int(i), VALID[int(i)])
        with accelerator.accumulate(engine):
            loss = dz.loss_sum(engine, tokens, labels, False)
            if acc is None:
                accelerator.backward(loss / VALID[int(i)])
            else:
                with acc.microbatch(weight=VALID[int(i)]):
                    accelerator.backward(loss)
            sync = accelerator.sync_gradients
        if sync:
            windows.append(len(seen))
            errors.append(_error(engine, before, seen))
            seen, before = [], dz.full(engine)
    if acc is not None:
        acc.close()  # engine.step and engine.backward back to DeepSpeed's
    return {"errors": errors, "global_steps": engine.global_steps, "kind": str(accelerator.distributed_type),
            "stage": int(engine.zero_optimization_stage()), "windows": windows,
            "type": type(acc).__name__, "refused": _refusals(accelerator, engine, optimizer)}


def _refusals(accelerator: Any, engine: Any, optimizer: Any) -> list[str]:
    """What integrations.accelerate.exact says to a model that is not the engine, and to options."""
    from gradagg.integrations import accelerate as integration

    said = []
    for model, options in ((engine.module, {}), (engine, {"bucket_mb": 4})):
        try:
            integration.exact(accelerator, model, optimizer, **options).close()
        except Exception as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    return said


def _error(engine: Any, before: dict[str, torch.Tensor], seen: list[int]) -> float:
    """The window's applied gradient against the float64 token mean of every rank's sequences of the window."""
    every: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, seen)
    model = dz.Tiny().double()
    model.load_state_dict(before)
    for i in (i for ids in every for i in ids):
        dz.loss_sum(model, *dz.microbatch(0, 0, i, VALID[i]), False).backward()  # type: ignore[no-untyped-call]
    tokens = sum(VALID[i] for ids in every for i in ids)
    truth = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in model.parameters()])
    truth = truth / tokens
    after = dz.full(engine)
    applied = torch.cat([(before[n] - after[n]).flatten() for n in before]) / dz.LR
    return float((applied - truth).norm() / truth.norm())
