"""HF Trainer with FSDP1 (``fsdp="full_shard"``, ``fsdp_config={"version": 1}``) on every rank of a 2-rank gloo world.

transformers 5.24 builds Accelerate's FSDP plugin from ``TrainingArguments``: ``fsdp="full_shard"`` with
``fsdp_config={"version": 1}`` gives ``fsdp_version=1`` (without it the Trainer now defaults to FSDP2), its
transformer auto-wrap policy (the model's ``_no_split_modules``: one unit per ``LlamaDecoderLayer``),
``use_orig_params=True`` and ``sync_module_states=True`` by default. On a CPU two things stop that from running,
and each is changed here, nothing else:

* ``sync_module_states=False`` (a setting, through ``fsdp_config``): with it True, Accelerate's plugin looks for an
  accelerator device at construction and raises on a CPU, and FSDP1 refuses CPU tensors for the broadcast it would
  run. It would broadcast rank 0's weights; every rank builds the same seeded model, so they are equal already.
* :class:`FsdpOnCpuTrainer` overrides ``create_accelerator_and_postprocess`` (an overridable Trainer method): after
  the Trainer's own, it sets what Accelerate's state sets on an accelerator, as :mod:`.accel_fsdp1` does (on a CPU
  Accelerate drops the FSDP plugin and runs DDP): ``DistributedType.FSDP`` in both shared states, the plugin the
  Trainer built (rebuilt from the same ``fsdp_plugin_args``), the device ``cpu`` (FSDP1 on a CPU takes
  ``device_id`` without an index); and the Trainer's ``is_fsdp_enabled``, which it reads from that state once.

A case's ``strategy`` (SHARD_GRAD_OP, NO_SHARD) is given as ``accelerate launch`` gives it, in the environment
(:func:`_strategy`): Accelerate 1.15's FSDP1 plugin takes it from nowhere else.

The rest is the Trainer's and Accelerate's own code: ``accelerator.prepare`` wraps the model in FSDP1 with the
plugin's settings, the optimizer is created over the FSDP1 module's parameters, the Trainer enters
``accelerator.no_sync`` between syncs (FSDP1's ``no_sync()`` in the Trainer's own cases; nothing under
``exact()``, which replaces it), and its clip is ``accelerator.clip_grad_norm_``, which calls FSDP1's own
``clip_grad_norm_`` on the root.

Each step's gradient is read whole at ``on_pre_optimizer_step`` (after the clip), the model left as it was
(:func:`stepped_grads`); the data, windows and float64 truth are :mod:`.hf`'s.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import hf
from tests.torch.workers.fsdp1 import PREFIX, full_params

RATE = 2.0**12  # the read-back step's rate (see stepped_grads)


@functools.cache
def trainer_class() -> type:
    from transformers import Trainer

    class FsdpOnCpuTrainer(Trainer):  # type: ignore[misc]
        """The Trainer with Accelerate's state set as on an accelerator (see the module docstring)."""

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            as_on_an_accelerator(self)

    return FsdpOnCpuTrainer


def as_on_an_accelerator(trainer: Any) -> None:
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.device = torch.device("cpu")
    trainer.is_fsdp_enabled = True


def stepped_grads(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole gradient the optimizer is about to step on and the whole parameters, the model left as it was.

    ``use_orig_params=True``: summoned with the gradients (FSDP1's ``with_grads``, exact). Flat parameters cannot
    be summoned with theirs: an SGD step of rate 2**12 on the shards, ``(before - after) / 2**12`` (a power of two:
    scaled exactly; at rate 1 the float32 rounding of a norm weight of 1.0 is ~6e-6 of these clipped gradients,
    at 2**12 that much smaller), the parameters then put back bit for bit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if getattr(model, "_use_orig_params", False):
        with FSDP.summon_full_params(model, with_grads=True):
            named = [(n.replace(PREFIX, ""), p) for n, p in model.named_parameters()]
            return ({n: p.grad.detach().clone() for n, p in named if p.grad is not None},
                    {n: p.detach().clone() for n, p in named})
    params = [p for p in model.parameters() if p.grad is not None]
    kept = [p.detach().clone() for p in params]
    before = full_params(model)
    torch.optim.SGD(params, lr=RATE).step()  # the gradients are left as they are: no momentum, no decay
    after = full_params(model)
    with torch.no_grad():
        for p, k in zip(params, kept):
            p.copy_(k)
    return {n: (before[n] - after[n]) / RATE for n in before}, before


class Recorder(hf.Recorder):
    """:class:`.hf.Recorder` reading FSDP1's shards whole."""

    def on_step(self, model: torch.nn.Module) -> None:
        grads, params = stepped_grads(model)
        mine, self.pending = self.pending, []
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        self.steps.append({"grads": grads, "params": params, "seqs": [s for part in every for s in part]})


def run_case(case: hf.Case) -> dict[str, Any]:
    """Train one case; on rank 0 each step's error against the truth, the logs and what the Trainer built; a
    refusal gathered from every rank."""
    from gradagg.integrations.transformers import exact

    with tempfile.TemporaryDirectory() as out, _strategy(case.get("strategy")):
        args = hf.training_args({**case, "fsdp1": True}, out)
        rows = tl.sequences(3, case["rows"]) if "rows" in case else hf.dataset_rows()
        trainer = trainer_class()(model=tl.model(0), args=args, train_dataset=rows, data_collator=tl.collate)
        refused: str | None = None
        try:
            if case.get("exact"):
                exact(trainer)
            rec = Recorder()
            rec.wrap(trainer)
            trainer.train()
        except Exception as exc:  # a refusal: every rank must raise it, none may hang
            refused = f"{type(exc).__name__}: {exc}"
        every = hf.refusals(refused)
        if every is not None:
            return {"refused": every} if dist.get_rank() == 0 else {}
        wrapped = type(trainer.model_wrapped).__name__
        units = sum(type(m).__name__ == "FullyShardedDataParallel" for m in trainer.model_wrapped.modules())
        strategy = trainer.model_wrapped.sharding_strategy.name
    if dist.get_rank() != 0:
        return {}
    return {"wrapped": wrapped, "units": units, "strategy": strategy, "logs": rec.logs,
            "steps": [hf.score(s, case.get("clip", 0.0)) for s in rec.steps]}


@contextlib.contextmanager
def _strategy(name: str | None) -> Iterator[None]:
    """FSDP1's sharding strategy as ``accelerate launch --fsdp_sharding_strategy`` gives it: the environment's
    ``FSDP_SHARDING_STRATEGY``. Accelerate 1.15's FSDP1 plugin reads the strategy from there and nowhere else: the
    Trainer's ``fsdp="shard_grad_op"`` reaches its ``reshard_after_forward``, which ``prepare`` reads only when no
    strategy is set, and the plugin always sets one (FULL_SHARD by default)."""
    if name is None:
        yield
        return
    os.environ["FSDP_SHARDING_STRATEGY"] = name
    try:
        yield
    finally:
        del os.environ["FSDP_SHARDING_STRATEGY"]


def cases_world(cases: list[hf.Case]) -> list[dict[str, Any]]:
    """Every case in turn on this rank, in one world."""
    hf.launcher_environment()
    return [run_case(c) for c in cases]


__all__ = ["cases_world"]
