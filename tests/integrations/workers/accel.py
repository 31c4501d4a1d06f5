"""Accelerate on every rank of a 2-rank gloo world: gradagg's loop and Accelerate's own recipe, step by step.

Every case runs two epochs of the 10 microbatches (5 per rank: a window of 3, then the short last one of 2) from
an Accelerate-prepared DataLoader, with Accelerate's defaults otherwise (its DDP broadcasts buffers), and records
each optimizer step's gradient next to the sequences the step consumed on all ranks (see ``steps``).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import steps as st


def accelerate_world(cases: list[tuple[str, float | None]], mixed_precision: str = "no") -> dict[str, Any]:
    """Run each ``(loop, clip)`` case; loop is "exact" (accelerator.backward), "two" (the same with two optimizers),
    "plain" (.backward()) or "native" (Accelerate's documented accumulate() recipe with the model's mean loss).
    ``mixed_precision``: Accelerate's switch, for the whole world (its state is set once per process)."""
    st.launcher_env()
    out: dict[str, Any] = {}
    for loop, clip in cases:
        out[f"{loop}/{clip}"] = _case(loop, clip, mixed_precision)
    if mixed_precision == "no":
        out["refused_nested"] = _nested_accumulate_refused()
    return out


def _prepared(two: bool = False, mixed_precision: str = "no") -> tuple[Any, Any, Any, Any]:
    """Accelerate's objects; ``two``: two optimizers, Muon beside AdamW's split (the matrices in one, the
    embedding and the norms in the other), prepared together and given to exact() as a list."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=st.STEPS, mixed_precision=mixed_precision)
    model = tl.model(0)
    if two:
        named = list(model.named_parameters())
        matrices = [p for n, p in named if p.ndim == 2 and "embed" not in n]
        rest = [p for n, p in named if p.ndim != 2 or "embed" in n]
        optimizers = [torch.optim.SGD(matrices, lr=0.5), torch.optim.Adam(rest, lr=1e-3)]
    else:
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.5)]
    loader = torch.utils.data.DataLoader(st.Indexed(), batch_size=st.PER_MICROBATCH, collate_fn=st.collate)
    model, *optimizers, loader = accelerator.prepare(model, *optimizers, loader)
    return accelerator, model, optimizers if two else optimizers[0], loader


def _case(loop: str, clip: float | None, mixed_precision: str = "no") -> dict[str, Any]:
    from gradagg.integrations.accelerate import exact

    accelerator, model, optimizer, loader = _prepared(two=loop == "two", mixed_precision=mixed_precision)
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    acc = None if loop == "native" else exact(accelerator, model, optimizer)
    inner, rec, fresh = accelerator.unwrap_model(model), st.Recorder(), True
    seen = _seen_by_each(inner, optimizers) if loop == "two" else None
    for batch in (b for _ in range(st.EPOCHS) for b in loader):
        rec.saw(batch.pop("idx"))
        with accelerator.accumulate(model):
            if fresh:
                rec.begin(inner)
            fresh = False
            if acc is None:
                accelerator.backward(model(**batch).loss)
            else:
                with acc.microbatch(weight=tl.tokens(batch)):
                    loss = tl.token_sum_loss(model, batch)
                    loss.backward() if loop == "plain" else accelerator.backward(loss)
            if accelerator.sync_gradients:
                if clip is not None:
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                rec.stepped(inner)
                fresh = True
            for o in optimizers:  # the first step (or the clip) finds the window finished at the sync microbatch
                o.step()
            if seen and fresh:  # what each optimizer saw at its own step, not the model's .grad before them
                rec.grads[-1] = dict(seen)
                seen.clear()
            for o in optimizers:
                o.zero_grad()
    result = st.step_errors(rec, clip)
    if acc is not None:  # exact() holds DDP's buffer broadcast (it broadcasts per window); close() gives it back
        result["sync_during"] = model.forward_sync_buffers
        acc.close()
        result["sync_after"] = model.forward_sync_buffers
    result["model"] = type(model).__name__
    result["distributed_type"] = str(accelerator.distributed_type)
    return result


def _seen_by_each(model: torch.nn.Module, optimizers: list[Any]) -> dict[str, torch.Tensor]:
    """The gradient of each parameter as its own optimizer's step starts (a step pre-hook registered after
    exact()'s), filled as the optimizers step."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def record(opt: torch.optim.Optimizer, *_: Any) -> None:
        for group in opt.param_groups:
            seen.update((names[id(p)], p.grad.detach().clone()) for p in group["params"] if p.grad is not None)

    for o in optimizers:
        o.optimizer.register_step_pre_hook(record)
    return seen


def _nested_accumulate_refused() -> str:
    from gradagg.integrations.accelerate import exact

    accelerator, model, optimizer, loader = _prepared()
    acc = exact(accelerator, model, optimizer)
    batch = next(iter(loader))
    batch.pop("idx")
    try:
        with acc.microbatch(weight=tl.tokens(batch)), accelerator.accumulate(model):
            accelerator.backward(tl.token_sum_loss(model, batch))
    except Exception as exc:  # the WindowError under test
        return f"{type(exc).__name__}: {exc}"
    return "not refused"
