"""Rank workers for torchtitan: its own Trainer.train_step and examples/torchtitan_exact.py, on torchtitan's own model.

:class:`CpuTrainer` is torchtitan's ``Trainer`` holding only what ``train_step`` reads, built from torchtitan's own
parts (the parallelized model of :mod:`.titan_model`, its loss, optimizer container, LR schedulers, batch generator):
``Trainer.__init__`` would also load a tokenizer, a dataset and a checkpointer from files, which a test has none of.
Every optimizer step is recorded by a global optimizer step pre-hook: the full parameters and (clipped) gradients the
optimizer is about to use, and the metrics torchtitan would log. The tests compare them with the float64 truth.
"""

from __future__ import annotations

import importlib.util
import math
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.integrations import tiny_llama
from tests.integrations.workers import titan_model as tm

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "torchtitan_exact.py"
SEQS_PER_MICROBATCH = 2
MAX_NORM = 0.1  # below every window's gradient norm here (0.3 to 0.5): every step clips


class _Metrics:
    """torchtitan's MetricsProcessor as train_step uses it: log every step, keep what was logged."""

    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        self.logged.append({"loss": global_avg_loss, "max_loss": global_max_loss, "grad_norm": grad_norm})


class _NoCheckpoint:
    def maybe_wait_for_staging(self) -> None:
        return None


def _trainer_class() -> type:
    from torchtitan.trainer import Trainer

    class CpuTrainer(Trainer):  # type: ignore[misc, valid-type]
        """torchtitan's Trainer, holding what train_step reads (module docstring)."""

        def __init__(self, backend: str, ac: bool, accumulation_steps: int, set_to_none: bool, chunked: bool) -> None:
            from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
            from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
            from torchtitan.config import TrainingConfig
            from torchtitan.distributed import utils as dist_utils

            dims = tm.parallel_dims(backend)
            self.parallel_dims, self.device, self.step, self.ntokens_seen = dims, torch.device("cpu"), 0, 0
            # disable_cuda_graphs=False is torchtitan's default, hence its zero_grad(set_to_none=False).
            self.config = Trainer.Config(parallelism=tm.parallelism(backend), training=TrainingConfig(
                max_norm=MAX_NORM, disable_cuda_graphs=set_to_none))
            self.model_config = tm.tiny_config()
            self.model_parts = [tm.build(backend, ac, dims)]
            self.loss_fn = CrossEntropyLoss.Config().build()
            # The llama3 configs' loss: lm_head and its backward run inside the loss, chunk by chunk (set up as
            # Trainer.__init__ does).
            if chunked:
                self.loss_fn = ChunkedLossWrapper.Config(num_chunks=2).build()
                self.loss_fn.set_lm_head(self.model_parts[0].lm_head)
                self.model_parts[0]._skip_lm_head = True  # type: ignore[assignment]
            self.optimizers = default_adamw(lr=1e-3, implementation="foreach").build(model_parts=self.model_parts)
            self.lr_schedulers = LRSchedulersContainer.Config().build(optimizers=self.optimizers, training_steps=10)
            self.metrics_processor, self.checkpointer = _Metrics(), _NoCheckpoint()
            self.gradient_accumulation_steps, self.num_pipeline_parallel_microbatches = accumulation_steps, 1
            self.train_context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
            self.fwd_bwd_fn = self._forward_backward_body

    return CpuTrainer


def trainer(backend: str, ac: bool, accumulation_steps: int = 3, set_to_none: bool = False,
            chunked: bool = False) -> Any:
    tm.cpu_shims()
    return _trainer_class()(backend, ac, accumulation_steps, set_to_none, chunked)


def example() -> Any:
    """examples/torchtitan_exact.py as a module (examples/ is not a package), after the CPU shims."""
    tm.cpu_shims()
    spec = importlib.util.spec_from_file_location("torchtitan_exact", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- data -----------------------------------------------------------------------------------------------------


def plan(windows: list[list[int]]) -> list[list[list[list[dict[str, list[int]]]]]]:
    """Sequences by [window][rank][microbatch]: ``windows[w][r]`` microbatches of 2 sequences, each of its own seed."""
    out = []
    for w, counts in enumerate(windows):
        out.append([[tiny_llama.sequences(1000 * w + 100 * r + j, SEQS_PER_MICROBATCH) for j in range(n)]
                    for r, n in enumerate(counts)])
    return out


def rank_batches(seqs: list[list[list[list[dict[str, list[int]]]]]], rank: int) -> list[tm.Batch]:
    """This rank's microbatches, window after window, in torchtitan's batch format."""
    return [tm.to_titan(mb) for window in seqs for mb in window[rank]]


def window_seqs(seqs: list[list[list[list[dict[str, list[int]]]]]], w: int) -> list[dict[str, list[int]]]:
    return [s for rank in seqs[w] for mb in rank for s in mb]


# --- recording ------------------------------------------------------------------------------------------------


class Recorder:
    """A global optimizer step pre-hook: the full parameters and gradients each step is about to apply.

    It records at the step of the container's one AdamW, not of the container itself: global pre-hooks run before
    the container's own (where an attached accumulator finishes the window)."""

    def __init__(self, tr: Any) -> None:
        self.model, self.inner, self.steps = tr.model_parts[0], list(tr.optimizers), []  # type: ignore[var-annotated]
        self.handle = register_optimizer_step_pre_hook(self._record)

    def _record(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not any(optimizer is o for o in self.inner):
            return
        # Full tensors are collectives: every rank steps its one AdamW once per step, in the same order.
        self.steps.append({"params": tm.full_params(self.model), "grads": tm.full_grads(self.model)})

    def remove(self) -> None:
        self.handle.remove()


def run_steps(tr: Any, batches: list[tm.Batch], step: Callable[[Iterator[Any]], Any],
              sizes: list[int] | None = None) -> dict[str, Any]:
    """Run ``step`` until the data ends (torchtitan's DataloaderExhaustedError, whose step index is kept);
    ``sizes`` sets gradient_accumulation_steps per step (torchtitan's own step needs them ahead)."""
    from torchtitan.components.dataloader import DataloaderExhaustedError

    rec = Recorder(tr)
    data = tr.batch_generator(batches)
    ended = None
    try:
        for k in range(len(sizes) if sizes else 10):
            if sizes:
                tr.gradient_accumulation_steps = sizes[k]
            tr.step = k + 1
            try:
                step(data)
            except DataloaderExhaustedError:
                ended = k
                break
    finally:
        rec.remove()
    return {"steps": rec.steps, "logged": tr.metrics_processor.logged, "ended": ended}


def compare(run: dict[str, Any], seqs: Any) -> list[dict[str, float]]:
    """Per step: relative error of the applied gradient against the clipped float64 truth; norms; logged loss."""
    out = []
    for w, rec in enumerate(run["steps"]):
        grads, loss = tm.truth(rec["params"], window_seqs(seqs, w))
        want, norm = tm.clipped(grads, MAX_NORM)
        logged = run["logged"][w] if w < len(run["logged"]) else {}
        out.append({"error": tiny_llama.relative_error(rec["grads"], want), "norm": norm, "loss": loss,
                    "logged_norm": logged.get("grad_norm", math.nan), "logged_loss": logged.get("loss", math.nan)})
    return out


# --- worlds ---------------------------------------------------------------------------------------------------

WINDOWS_EVEN = [[3, 3], [3, 3], [2, 2]]  # the last window short on both ranks
WINDOWS_UNEVEN = [[3, 3], [3, 3], [2, 1]]  # ... and the data ending unevenly: rank 1 has one microbatch fewer
WINDOWS_BOUNDARY = [[3, 3], [3, 3]]  # the data ends with the second window: the third finds none on any rank


def exact_world(configs: list[tuple[str, bool, bool, bool]]) -> dict[str, Any]:
    """Per (backend, activation checkpointing, set_to_none, chunked loss): torchtitan's own train_step and the
    example's on the same data (the last window short), then the example with the data ending unevenly (rank 1 one
    microbatch short). Rank 0 returns each run's per-step comparison with the
    truth; every rank returns where its data ended."""
    rank, ex = dist.get_rank(), example()
    out: dict[str, Any] = {}
    for backend, ac, set_to_none, chunked in configs:
        runs: dict[str, Any] = {}
        seqs = plan(WINDOWS_EVEN)
        tr = trainer(backend, ac, set_to_none=set_to_none, chunked=chunked)
        # torchtitan's own step needs each window's size ahead (it would drop the short one): given per step.
        own = run_steps(tr, rank_batches(seqs, rank), tr.train_step, sizes=[3, 3, 2])
        runs["own"] = compare(own, seqs) if not rank else None
        cases = [("exact", WINDOWS_EVEN), ("exact uneven", WINDOWS_UNEVEN)]
        if not out:  # the first config also ends its data exactly at a window's end (a full window, then none)
            cases.append(("exact boundary", WINDOWS_BOUNDARY))
        for name, windows in cases:
            try:
                seqs = plan(windows)
                tr = trainer(backend, ac, set_to_none=set_to_none, chunked=chunked)
                # ExactTrainer's train_step on the CPU trainer (a plain function reading torchtitan's attributes).
                run = run_steps(tr, rank_batches(seqs, rank), partial(ex.ExactTrainer.train_step, tr))
                runs[name] = {"steps": compare(run, seqs) if not rank else None, "ended": run["ended"]}
            except Exception as exc:  # the case's result: the test reports it
                runs[name] = {"raised": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
                continue
            if name == "exact" and not rank:  # the same data as torchtitan's own run: the two applied gradients
                runs["own vs exact"] = [tiny_llama.relative_error(e["grads"], o["grads"])
                                        for e, o in zip(run["steps"], own["steps"], strict=True)]
        out[", ".join(map(str, (backend, ac, set_to_none, chunked)))] = runs
    return out


def _window(acc: Any, tr: Any, batches: list[tm.Batch]) -> None:
    """One window the example's way (weights, summed losses, finish), without its clip and step."""
    ones = torch.ones((), dtype=torch.int64)
    for input_dict, labels in acc.microbatches(batches):
        with acc.microbatch(weight=(labels != -100).sum()):
            tr.forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=ones)
    acc.finish()


def _case(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}


def layout_case(backend: str, ac: bool) -> dict[str, Any]:
    """One exact window on torchtitan's parallelized model: error against the float64 truth (no clip)."""
    from gradagg.torch import MicrobatchAccumulator

    rank, seqs = dist.get_rank(), plan([[3, 2]])
    tr = trainer(backend, ac)
    params = tm.full_params(tr.model_parts[0])
    _window(MicrobatchAccumulator(tr.model_parts[0]), tr, rank_batches(seqs, rank))
    got = tm.full_grads(tr.model_parts[0])
    return {"error": tiny_llama.relative_error(got, tm.truth(params, window_seqs(seqs, 0))[0])}


def zero_grad_case() -> dict[str, Any]:
    """Two windows with torchtitan's zero_grad(set_to_none=False) between them: the second window's error."""
    from gradagg.torch import MicrobatchAccumulator

    rank, seqs = dist.get_rank(), plan([[2, 1], [1, 3]])
    tr = trainer("partial_dtensor", ac=False)
    model = tr.model_parts[0]
    acc = MicrobatchAccumulator(model)
    _window(acc, tr, [tm.to_titan(mb) for mb in seqs[0][rank]])
    tr.optimizers.zero_grad(set_to_none=False)
    params = tm.full_params(model)
    _window(acc, tr, [tm.to_titan(mb) for mb in seqs[1][rank]])
    return {"error": tiny_llama.relative_error(tm.full_grads(model), tm.truth(params, window_seqs(seqs, 1))[0])}


def attach_case() -> dict[str, Any]:
    """``acc.attach(trainer.optimizers)`` (torchtitan's OptimizersContainer), the window left to the step to finish,
    torchtitan's clip before the step: the step must apply the clipped exact gradient, or the clip must raise."""
    from torchtitan.distributed import utils as dist_utils

    from gradagg.errors import GradaggError
    from gradagg.torch import MicrobatchAccumulator

    rank, seqs = dist.get_rank(), plan([[3, 2]])
    tr = trainer("partial_dtensor", ac=False)
    model = tr.model_parts[0]
    acc = MicrobatchAccumulator(model)
    acc.attach(tr.optimizers)
    rec = Recorder(tr)
    params = tm.full_params(model)
    ones = torch.ones((), dtype=torch.int64)
    try:
        for input_dict, labels in acc.microbatches(rank_batches(seqs, rank)):
            with acc.microbatch(weight=(labels != -100).sum()):
                tr.forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=ones)
        try:
            dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
        except GradaggError as exc:  # refused: the right outcome when it names the clip
            return {"refused": str(exc)}
        tr.optimizers.step()
    finally:
        rec.remove()
    want, norm = tm.clipped(tm.truth(params, window_seqs(seqs, 0))[0], MAX_NORM)
    return {"error": tiny_llama.relative_error(rec.steps[0]["grads"], want), "norm": norm}


def today_world() -> dict[str, dict[str, Any]]:
    """Each way torchtitan's model meets the accumulator, one case each (an error caught is that case's result)."""
    return {
        "plain": _case(lambda: layout_case("partial_dtensor", ac=False)),
        "activation checkpointing": _case(lambda: layout_case("partial_dtensor", ac=True)),
        "full_dtensor": _case(lambda: layout_case("full_dtensor", ac=False)),
        "full_dtensor, activation checkpointing": _case(lambda: layout_case("full_dtensor", ac=True)),
        "zero_grad(set_to_none=False)": _case(zero_grad_case),
        "attach and clip": _case(attach_case),
    }

