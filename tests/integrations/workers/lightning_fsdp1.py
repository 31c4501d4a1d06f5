"""Lightning's ``FSDPStrategy`` (FSDP1) on every rank of a 2-rank gloo world, on a CPU, with ExactAccumulation.

Lightning refuses ``FSDPStrategy`` on a CPU in one place: its accelerator connector raises "The strategy `fsdp`
requires a GPU accelerator" when the strategy flag is the string ``"fsdp"`` or an object whose type *is*
``FSDPStrategy``. What is changed, and why (everything else is Lightning's own code, unpatched):

* the strategy is :class:`CPUFSDPStrategy`, a subclass: the connector's check (``type(flag) is FSDPStrategy``)
  does not match it, which lifts the refusal;
* while Lightning's own ``_setup_model`` wraps the module, FSDP1 gets ``device_id=torch.device("cpu")`` where
  Lightning passes ``root_device.index`` (a GPU's index there; a CPU device has none, and FSDP1 given None looks for
  an accelerator and raises). This is the one argument a GPU would set otherwise.

So ``_setup_model`` builds FSDP1 as on a GPU: ``FullyShardedDataParallel(lightning_module,
auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=<Lightning's default True, or False>,
sharding_strategy=FULL_SHARD, mixed_precision=MixedPrecision(float32 x 3)`` (FSDPPrecision's for "32-true"),
``cpu_offload=CPUOffload(False))``: the root and one unit per decoder layer. Lightning's forward redirection runs
``training_step`` through the FSDP1 root (its pre-forward hooks, gradagg's among them, see it); its precision
plugin runs the closure (forward, ``zero_grad`` on a window's first batch, backward), then
``on_before_optimizer_step`` (the callback's ``finish()``), then ``configure_gradient_clipping``, then the step.

Clipping: Lightning's ``FSDPPrecision.clip_grad_by_norm`` raises ("gradient_clip_algorithm='norm' is currently not
supported"), on a GPU as here, because ``torch.nn.utils.clip_grad_norm_`` over shards is wrong; the way to clip by
norm under this strategy is the module's ``configure_gradient_clipping`` calling FSDP1's own
``clip_grad_norm_`` on the root (``self.trainer.strategy.model``), which this worker does.

Plans: "even" is Lightning's DistributedSampler (5 microbatches per rank per epoch: windows of 3 and 2, token
counts that differ per rank and microbatch); "none" turns the sampler off and gives rank 1, in the short window of
each epoch, two microbatches whose labels are all -100 (weight 0: that rank has no tokens in the window). The ranks
run as many microbatches as each other in every plan but "uneven" (5 and 4, refused by the callback before the
first batch): Lightning itself broadcasts from rank 0 at every training batch (its SIGTERM check,
``_broadcast_sigterm_tensor``), so a rank that ran more batches than another would desynchronise the collectives
under any strategy (without the refusal, a gloo timeout). Each step's gradient is read back as an SGD step of rate 1
(parameters at the window's start minus after the step, summoned whole: FSDP1 holds shards) and compared, on
rank 0, with the float64 one-process token mean of the sequences the step consumed on both ranks (:mod:`.steps`).
"""

from __future__ import annotations

import contextlib
import unittest.mock
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tests.integrations import tiny_llama as tl
from tests.integrations.workers import steps as st

PREFIX = "_fsdp_wrapped_module."
# the shared sequences, then unlabelled copies of 16..19 (every label -100: no token counts)
SEQS = st.SEQS + [{"input_ids": s["input_ids"], "labels": [-100] * len(s["labels"])} for s in st.SEQS[16:]]
NONE = {0: list(range(10)), 1: [*range(10, 16), *range(20, 24)]}  # rank 1's last two microbatches count nothing
UNEVEN = {0: list(range(10)), 1: list(range(10, 18))}  # 5 and 4 microbatches per epoch: refused


def lightning_fsdp1_world(cases: list[tuple[str, bool, float | None, str]]) -> dict[str, Any]:
    """Each ``(loop, use_orig_params, clip, plan)``: loop "exact" (ExactAccumulation, ``{"loss", "weight"}``) or
    "native" (no callback, the model's mean loss) or "lightning-clip" (ExactAccumulation, Lightning's own norm clip:
    refused by Lightning); plan "even", "none" or "uneven" (refused by the callback), with ``-bf16`` for Lightning's
    ``precision="bf16-mixed"``. The step errors and what was built, or the refusal."""
    st.launcher_env()
    return {f"{loop}/{orig}/{clip}/{plan}": _case(loop, orig, clip, plan) for loop, orig, clip, plan in cases}


def _strategy_class() -> type:
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):  # type: ignore[misc]
        """FSDPStrategy with two differences: its type (which lifts the connector's GPU check) and FSDP1's
        ``device_id`` while Lightning's own ``_setup_model`` wraps the module (see :func:`_cpu_device_id`)."""

        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            with _cpu_device_id():
                return super()._setup_model(model)  # type: ignore[no-any-return]

    return CPUFSDPStrategy


@contextlib.contextmanager
def _cpu_device_id() -> Iterator[None]:
    """FSDP1 built with ``device_id=cpu`` where Lightning passes ``root_device.index``: on a GPU that is the GPU's
    index; a CPU device has none, and with ``device_id=None`` FSDP1 looks for an accelerator ("FSDP needs a non-CPU
    accelerator device"). Every other argument is Lightning's; the nested units built by the auto-wrap policy take
    the root's ``device_id``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    init = FSDP.__init__

    def on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("device_id", 0) is None:
            kwargs["device_id"] = torch.device("cpu")
        init(self, *args, **kwargs)

    with unittest.mock.patch.object(FSDP, "__init__", on_cpu):
        yield


def _module(loop: str, orig: bool, rec: st.Recorder) -> Any:
    import lightning.pytorch as pl

    class TinyLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tl.model(0)

        def on_train_start(self) -> None:
            model = self.trainer.strategy.model
            self.built = {"model": type(model).__name__, "strategy": model.sharding_strategy.name,
                          "orig": model._use_orig_params,  # private: FSDP1 has no public reader of the option
                          "param_dtype": str(model.mixed_precision.param_dtype),
                          "device": str(self.trainer.strategy.root_device),
                          "units": sum(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())}

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            rec.saw(batch.pop("idx"))
            if loop == "native":
                return self.model(**batch).loss
            return {"loss": tl.token_sum_loss(self.model, batch), "weight": tl.tokens(batch)}

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                        gradient_clip_algorithm: Any = None) -> None:
            if loop == "lightning-clip":  # Lightning's default: FSDPPrecision.clip_grad_by_norm, which raises
                self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            elif gradient_clip_val:  # FSDP1's own clip on the root: Lightning's norm clip refuses this strategy
                self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx % st.STEPS == 0:  # a window's start, on every rank at once (FSDP1's summon is a collective)
                rec.starts.append(_full(self.trainer.strategy.model))

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            optimizer.step(closure=optimizer_closure)  # the closure (last backward), finish(), the clip, the step
            before, after = rec.starts[-1], _full(self.trainer.strategy.model)
            rec.grads.append({n: before[n] - after[n] for n in before})
            rec.indices.append(rec.pending)
            rec.pending = []

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # use_orig_params=False: the optimizer must hold FSDP1's flat parameters (Lightning's rule)
            params = self.parameters() if orig else self.trainer.model.parameters()
            return torch.optim.SGD(params, lr=1.0)

    return TinyLlama()


def _full(root: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, named as in the bare model (the LightningModule's ``model.`` and FSDP1's prefixes off)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(root):
        return {n.replace(PREFIX, "").removeprefix("model."): p.detach().clone() for n, p in root.named_parameters()}


def _loader(plan: str) -> torch.utils.data.DataLoader[Any]:
    data: Any = {"none": NONE, "uneven": UNEVEN}[plan][dist.get_rank()] if plan in ("none", "uneven") else st.Indexed()
    return torch.utils.data.DataLoader(data, batch_size=st.PER_MICROBATCH, collate_fn=_collate)


def _collate(indices: list[int]) -> dict[str, torch.Tensor]:
    out = tl.collate([SEQS[i] for i in indices])
    out["idx"] = torch.tensor(indices)
    return out


def _case(loop: str, orig: bool, clip: float | None, plan: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from gradagg.integrations.lightning import ExactAccumulation

    rec = st.Recorder()
    strategy = _strategy_class()(process_group_backend="gloo", auto_wrap_policy={LlamaDecoderLayer},
                                 use_orig_params=orig)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, max_epochs=st.EPOCHS,
                         accumulate_grad_batches=st.STEPS, gradient_clip_val=clip,
                         callbacks=[] if loop == "native" else [ExactAccumulation()],
                         precision="bf16-mixed" if plan.endswith("-bf16") else "32-true",
                         use_distributed_sampler=plan not in ("none", "uneven"), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    module = _module(loop, orig, rec)
    try:
        trainer.fit(module, _loader(plan))
    except Exception as exc:  # the refusals under test (loop "lightning-clip", plan "uneven"), on every rank
        if loop != "lightning-clip" and plan != "uneven":
            raise
        return {"error": f"{type(exc).__name__}: {exc}"}
    result = st.step_errors(rec, clip, SEQS)
    result.update(module.built)
    return result


__all__ = ["lightning_fsdp1_world"]
