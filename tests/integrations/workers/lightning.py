"""Lightning on every rank of a 2-rank gloo world: ExactAccumulation and Lightning's own accumulation, per step.

Lightning is driven inside the world the harness already initialised: ``steps.launcher_env`` sets what
``torchrun`` would (TORCHELASTIC_RUN_ID among them), so Lightning's TorchElasticEnvironment takes the processes
as launched externally and its strategy finds the process group initialised and reuses it. Each case fits two
epochs of 10 microbatches (5 per rank from Lightning's DistributedSampler: a window of 3, then the short last
window of 2) and records each optimizer step's gradient, after Lightning's clipping, next to the sequences the
step consumed on all ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import steps as st


def lightning_world(cases: list[tuple[str, str, float | None]]) -> dict[str, Any]:
    """Run each ``(strategy, loop, clip)``: strategy "ddp" or "fsdp2" (ModelParallelStrategy with fully_shard), with
    ``-bf16`` for Lightning's ``precision="bf16-mixed"``;
    loop "dict" (``{"loss", "weight"}``), "fn" (``ExactAccumulation(weight=fn)``), "native" (no callback, the
    model's mean loss) or "noweight" (the callback, a bare summed loss: refused)."""
    st.launcher_env()
    return {f"{s}/{loop}/{clip}": _case(s, loop, clip) for s, loop, clip in cases}


def _module(loop: str, fsdp: bool, rec: st.Recorder) -> Any:
    import lightning.pytorch as pl

    class TinyLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tl.model(0)

        def configure_model(self) -> None:
            if fsdp:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def on_train_start(self) -> None:
            self.wrapped = type(self.trainer.strategy.model).__name__  # what the strategy built

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx % st.STEPS == 0:
                rec.begin(self.model)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            rec.saw(batch.pop("idx"))
            if loop == "native":
                return self.model(**batch).loss
            loss = tl.token_sum_loss(self.model, batch)
            return loss if loop in ("fn", "noweight") else {"loss": loss, "weight": tl.tokens(batch)}

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                        gradient_clip_algorithm: Any = None) -> None:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            rec.stepped(self.model)  # what the optimizer is about to see

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return TinyLlama()


def _strategy(name: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")


def _case(strategy: str, loop: str, clip: float | None) -> dict[str, Any]:
    import lightning.pytorch as pl

    from gradagg.integrations.lightning import ExactAccumulation

    rec = st.Recorder()
    precision = "bf16-mixed" if strategy.endswith("-bf16") else "32-true"
    strategy = strategy.removesuffix("-bf16")
    callbacks = {"native": [], "dict": [ExactAccumulation()], "noweight": [ExactAccumulation()],
                 "fn": [ExactAccumulation(weight=lambda b, _i: tl.tokens(b))]}[loop]
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=_strategy(strategy), max_epochs=st.EPOCHS,
                         accumulate_grad_batches=st.STEPS, gradient_clip_val=clip, callbacks=callbacks,
                         precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(st.Indexed(), batch_size=st.PER_MICROBATCH, collate_fn=st.collate)
    module = _module(loop, strategy == "fsdp2", rec)
    try:
        trainer.fit(module, loader)
    except Exception as exc:  # the refusal under test (loop "noweight"), raised on every rank
        if loop != "noweight":
            raise
        return {"error": f"{type(exc).__name__}: {exc}"}
    result = st.step_errors(rec, clip)
    result["model"] = module.wrapped
    result["sharded"] = any(hasattr(p, "device_mesh") for p in module.parameters())
    return result
