"""Accelerate's FSDP1 path on every rank of a 2-rank gloo world, on a CPU: its own prepare, accumulate and clip.

On a CPU Accelerate never chooses FSDP (its plugin is used only where an accelerator is found: it runs DDP
instead), so :func:`_as_on_an_accelerator` sets what Accelerate's state sets there: ``DistributedType.FSDP`` in
both shared states (``AcceleratorState`` copies it into ``PartialState``), the FSDP1 plugin, and the device
(``cpu``: FSDP1 on a CPU takes ``device_id`` without an index, where Accelerate's CPU device is ``cpu:0``). The rest
is Accelerate's own code: ``prepare`` wraps the model in FSDP1 with the plugin's settings (its transformer auto-wrap
policy, one unit per decoder layer, ``use_orig_params``), ``accumulate`` enters FSDP1's ``no_sync()`` in the
microbatches that do not sync, and ``clip_grad_norm_`` takes its FSDP branch (FSDP1's own clip).
``sync_module_states`` stays off: FSDP1 needs GPU tensors for it (every rank builds the same seeded model).

Data, windows and truth as :mod:`.accel` (2 epochs of 10 microbatches, windows of 3 then 2); each step's gradient
is read back through an SGD step of rate 1 (``before - after``, summoned whole: FSDP1 holds shards).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import steps as st
from tests.torch.workers.fsdp1 import full_params


def accelerate_fsdp1_world(cases: list[tuple[str, bool, float | None]]) -> dict[str, Any]:
    """Each ``(loop, use_orig_params, clip)``: loop "exact" (``exact()``, ``accelerator.backward(loss_sum)``) or
    "native" (Accelerate's documented recipe, the model's mean loss); the step errors, what was built."""
    st.launcher_env()
    return {f"{loop}/{orig}/{clip}": _case(loop, orig, clip) for loop, orig, clip in cases}


def _as_on_an_accelerator(accelerator: Any, plugin: Any) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.device = torch.device("cpu")


def _prepared(orig: bool) -> tuple[Any, Any, Any, Any]:
    """The model prepared first, then its optimizer (FSDP1 with flat parameters replaces them: Accelerate's rule)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], use_orig_params=orig)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=st.STEPS)
    _as_on_an_accelerator(accelerator, plugin)
    model = accelerator.prepare(tl.model(0))
    loader = torch.utils.data.DataLoader(st.Indexed(), batch_size=st.PER_MICROBATCH, collate_fn=st.collate)
    optimizer, loader = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=1.0), loader)
    return accelerator, model, optimizer, loader


def _case(loop: str, orig: bool, clip: float | None) -> dict[str, Any]:
    from gradagg.integrations.accelerate import exact

    accelerator, model, optimizer, loader = _prepared(orig)
    acc = exact(accelerator, model, optimizer) if loop == "exact" else None
    rec, fresh = st.Recorder(), True
    for batch in (b for _ in range(st.EPOCHS) for b in loader):
        rec.saw(batch.pop("idx"))
        with accelerator.accumulate(model):
            if fresh:
                rec.starts.append(full_params(model))
            fresh = False
            if acc is None:
                accelerator.backward(model(**batch).loss)
            else:
                with acc.microbatch(weight=tl.tokens(batch)):
                    accelerator.backward(tl.token_sum_loss(model, batch))
            if accelerator.sync_gradients:
                if clip is not None:
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                _stepped(rec, model, optimizer)
                fresh = True
            else:
                optimizer.step()  # Accelerate's optimizer steps only where gradients synced: nothing here
            optimizer.zero_grad()
    result = st.step_errors(rec, clip)
    if acc is not None:
        acc.close()
    result["model"] = type(model).__name__
    result["units"] = sum(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())
    result["distributed_type"] = str(accelerator.distributed_type)
    return result


def _stepped(rec: st.Recorder, model: torch.nn.Module, optimizer: Any) -> None:
    """The optimizer's step; its gradient, whole: the parameters before it minus after it (SGD of rate 1)."""
    before = full_params(model)
    optimizer.step()
    after = full_params(model)
    rec.grads.append({n: before[n] - after[n] for n in before})
    rec.indices.append(rec.pending)
    rec.pending = []


__all__ = ["accelerate_fsdp1_world"]
