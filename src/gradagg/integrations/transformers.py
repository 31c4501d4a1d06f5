"""Exact gradient accumulation inside a Hugging Face ``Trainer``: ``exact(trainer)``, one line before ``train()``.

What the Trainer computes on its own depends on its settings: with its defaults (``average_tokens_across_devices``
and a model whose forward takes loss kwargs) the global token mean; with ``average_tokens_across_devices=False``
the mean of per-rank token means; with a model that takes no loss kwargs, or a ``compute_loss`` that returns a
mean, the mean of microbatch means. After :func:`exact`, every optimizer step's gradient is

    sum over the window's microbatches on all ranks of the token-summed loss's gradient  /  tokens counted

whatever those settings, the per-rank and per-window counts and the short last window of an epoch. How, through
the Trainer's overridable methods only (they are replaced on the instance, so subclasses such as TRL's
``SFTTrainer`` keep their own ``compute_loss`` and ``training_step``, which are called inside):

* ``compute_loss`` is called with ``num_items_in_batch=None``: the loss comes back as the microbatch's mean over
  its own tokens (no factor for the world size or the window; a ``compute_loss_func`` is given the microbatch's
  own count) and is multiplied by the count, a sum;
  ``loss_is_scaled_for_ga = True`` keeps the Trainer from dividing it by the window's length.
* ``training_step`` runs inside a :class:`~gradagg.torch.MicrobatchAccumulator` microbatch weighted by the count,
  built on the first step around the model as the Trainer prepared it: DDP (``accelerator.prepare``), FSDP1
  (``fsdp="full_shard"`` with ``fsdp_config={"version": 1}``: Accelerate's FSDP plugin with ``fsdp_version=1``, the
  root :class:`~torch.distributed.fsdp.FullyShardedDataParallel` its ``prepare`` built; the accumulator's FSDP1
  shards form, :mod:`gradagg.torch.accumulate.wrappers.fsdp1`), or transformers' own FSDP2, a model sharded at load
  time by ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=...))``. On a CPU machine
  Accelerate's FSDP plugin gives DDP: the FSDP1 path ran on 2 gloo CPU ranks with Accelerate's state set as on a GPU
  (``tests/integrations/workers/hf_fsdp1.py``), FULL_SHARD and SHARD_GRAD_OP, ``use_orig_params`` True and False;
  not on a GPU.
  The Trainer marks the window's last microbatch (``accelerator.sync_gradients``); after it, ``finish()`` runs
  there, so the clip (``max_grad_norm``) and the logged ``grad_norm`` see the exact gradient. That step returns
  the window's token mean as its loss (the others 0), so the logged ``loss`` is the true token mean. At
  ``on_train_end`` the accumulator is closed (DDP and FSDP get their own synchronisation back).
* ``accelerator.no_sync`` does nothing while gradagg holds DDP's and FSDP2's synchronisation itself (FSDP2's
  ``no_sync`` would turn FSDP's reduction back on at its end). Under FSDP1 it would keep whole unsharded gradients
  through the window; without it FSDP1 reduce-scatters every microbatch through gradagg's summing communication
  hook, at sharded-gradient memory, and the clip is FSDP1's own ``clip_grad_norm_`` on the finished window.
  For transformers' own FSDP2 the Trainer defers FSDP's reduction itself around every microbatch but the
  window's last (``set_requires_gradient_sync(False)``); gradagg reduce-scatters every microbatch, so
  ``training_step`` turns it back on inside that context, through the public
  ``FSDPModule.set_requires_gradient_sync``. A callback checks at ``on_pre_optimizer_step`` that the
  window was finished.
* DDP's buffer broadcast is turned off when every buffer is non-persistent (derived from the config, e.g.
  Llama's rotary ``inv_freq``: the same on every rank by construction) and ``ddp_broadcast_buffers`` was not
  set: through DDP's public ``forward_sync_buffers`` once Accelerate built it (DDP's deprecated
  ``broadcast_buffers`` argument would warn on every rank), so DDP's one broadcast at construction still runs;
  otherwise DDP is as configured.

The microbatch's count, by default, is its labels other than -100 after the causal shift
(:func:`gradagg.integrations._tokens.label_tokens`), for causal LMs (the model's loss is ``ForCausalLM``), and its
preference pairs for TRL's ``DPOTrainer`` (half the rows of ``input_ids``); ``exact(trainer, weight=fn)`` gives it
for any other loss (``fn(inputs)``, the dict ``compute_loss`` receives; the loss is then taken as its mean over that
count). A ``compute_loss_func`` (which needs ``weight=``) receives that count as ``num_items_in_batch``, the
microbatch's own: a loss written ``sum / num_items_in_batch`` and one that returns its mean are both that mean.
A microbatch that counts 0 runs its forward but its backward reaches no parameter. A count that is not a number is
refused at once; a negative, NaN or infinite one makes ``finish()`` refuse the window on every rank (a ``WindowError``
naming the step, the rank, the microbatch and the value), and ``train()`` stops there without stepping.

DeepSpeed (``TrainingArguments(deepspeed=...)``, ZeRO stage 1, 2 or 3, float32): the accumulator is a
:class:`~gradagg.integrations.deepspeed.DeepSpeedAccumulator` on the engine (the Trainer's ``model_wrapped``), built
at the first step. The window is the Trainer's (``gradient_accumulation_steps``, which the Trainer also writes into
DeepSpeed's config: left there, since the engine steps only where Accelerate's backward of the window's last
microbatch calls ``engine.step()``, which finishes the window first); the backward never divides by those steps.
DeepSpeed clips the exact gradient (``max_grad_norm`` is its ``gradient_clipping``) and the logged ``grad_norm`` is
the norm it measured. With ``bf16=True`` (``"bf16": {"enabled": "auto"}`` or true in the config) the engine is bf16
and the accumulator keeps each window's sum in float32, rounded to bf16 once for DeepSpeed's reduction, as
``exact(engine)`` does (:mod:`gradagg.integrations.deepspeed`). ZeRO stage 0, fp16 (DeepSpeed's CPU accelerator has
none: its loss scaling under ``exact()`` never ran), the bf16 settings ``exact(engine)`` refuses
(``data_types.grad_accum_dtype`` other than bf16, ``bf16.check_grad_overflow`` false) and TRL trainers under
DeepSpeed are refused by ``exact()``.

TRL: ``SFTTrainer``, ``DPOTrainer`` (loss types that are a mean of a per-pair loss) and ``GRPOTrainer`` (its
``loss_type`` aggregated over the window, :mod:`gradagg.integrations._grpo`: its microbatch is opened in
``compute_loss``, once TRL generated and prepared it and its count is known) are made exact; every other TRL trainer
(RLOO, KTO, ...) is refused by ``exact()`` itself, naming it (:mod:`gradagg.integrations._trl`).
Their ``compute_loss`` gathers metrics across ranks at every microbatch, so ranks that would run different numbers
of microbatches (Accelerate's ``even_batches=False``) are refused on every rank at ``on_train_begin``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from gradagg.errors import GradaggError, WindowError
from gradagg.integrations._tokens import label_tokens
from gradagg.integrations._trl import check_even_microbatches, check_trl, default_weight

Weight = Callable[[Mapping[str, Any]], object]
_MARK = "_gradagg_exact"


def exact(trainer: Any, *, weight: Weight | None = None) -> Any:
    """Make every optimizer step of ``trainer`` use the exact global token-mean gradient; call once, before ``train()``.

    Args:
        trainer: a ``transformers.Trainer`` (subclasses included), not yet trained.
        weight: ``fn(inputs)`` giving a microbatch's count (a non-negative number or 0-dim tensor), for a loss
            that is a mean over something else than a causal LM's shifted labels. Default: those labels; the
            preference pairs for TRL's ``DPOTrainer``; the ``loss_type``'s count for ``GRPOTrainer`` (which takes no
            ``weight=``). A ``compute_loss_func`` gets this count as ``num_items_in_batch``.

    Returns:
        ``trainer``, changed in place.

    Raises:
        GradaggError: not a Trainer; ``exact()`` already applied; ``train()`` already ran; a setup gradagg does
            not make exact (DeepSpeed ZeRO stage 0, fp16, bf16 with ``data_types.grad_accum_dtype`` other than bf16 or
            ``bf16.check_grad_overflow`` false, or with a TRL trainer; ``DataParallel`` over several GPUs,
            tensor, context or sequence parallelism, a MoE auxiliary loss); a
            TRL trainer other than ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer``, a ``DPOTrainer`` whose
            ``loss_type`` is not a per-pair mean, a ``GRPOTrainer`` given
            ``weight=`` or that :func:`gradagg.integrations._grpo.check_grpo` refuses; a model or
            ``compute_loss_func`` whose loss it cannot count without ``weight``. At the start of ``train()``, on
            every rank: a TRL trainer whose ranks have different numbers of microbatches, another whose ranks have
            different numbers of optimizer steps per epoch. At the first step, on every rank: an FSDP1 model the
            accumulator refuses (:func:`gradagg.torch.accumulate.wrappers.fsdp1.refusal`: ``NO_SHARD``, bf16 or fp16
            parameters, ``keep_low_precision_grads``). During ``train()``: a
            count that is not a number (at once), or a negative, NaN or infinite one (``WindowError`` from the
            window's ``finish()``, on every rank).
    """
    _check_trainer(trainer)
    _check_setup(trainer)
    kind = check_trl(trainer)  # what TRL trainer this is: refused at once where exact() cannot make it exact
    if kind == "grpo" and weight is not None:
        raise GradaggError(f"exact() counts this {type(trainer).__name__}'s completions by its loss_type "
                           f"({trainer.loss_type!r}); it takes no weight=")
    count = weight if weight is not None else (
        default_weight(kind) or (_no_count if kind == "grpo" else _default_weight(trainer)))
    hold = _Exact(trainer, count, kind)
    trainer.compute_loss = hold.compute_loss
    if hold.user_loss_func is not None:
        trainer.compute_loss_func = hold.loss_func
    trainer.training_step = hold.training_step
    trainer.loss_is_scaled_for_ga = True
    trainer.accelerator.no_sync = _no_sync_held
    trainer.add_callback(_FinishedGuard(hold))
    hold.constant_buffers = _constant_buffers(trainer)
    setattr(trainer, _MARK, hold)
    return trainer


class _Exact:
    """The trainer's state under :func:`exact`: its original methods, the accumulator, the window's loss sum."""

    def __init__(self, trainer: Any, count: Weight, kind: str | None = None) -> None:
        self.trainer, self.count, self.kind = trainer, count, kind
        self.user_loss_func = getattr(trainer, "compute_loss_func", None)
        self.original_compute_loss = trainer.compute_loss
        self.original_training_step = trainer.training_step
        self.acc: Any = None
        self.model: Any = None
        self.fsdp_modules: list[Any] = []  # the model's FSDPModules, found once per accumulator
        self.pending: float | None = None  # the count of the microbatch whose training_step is running
        self.open_late: Callable[[object], object] | None = None  # GRPO: opens the running microbatch, given its count
        self.window_loss: Any = None  # this rank's token-summed loss over the open window (a tensor: no host sync)
        self.finished = False  # whether the current window was finished (reset by the guard at each step)
        self.constant_buffers = False  # DDP need not sync the buffers: all non-persistent, no ddp_broadcast_buffers

    def accumulator(self, model: Any) -> Any:
        """The accumulator around ``model`` as the Trainer prepared it (built at the first step, anew if it changes)."""
        if self.acc is None or self.model is not model:
            from gradagg.torch import MicrobatchAccumulator
            from gradagg.torch.accumulate.wrappers.ddp import skip_buffer_sync

            if self.acc is not None:
                self.acc.close()
            if self.trainer.is_deepspeed_enabled:  # model is the engine (the Trainer's model_wrapped)
                from gradagg.integrations.deepspeed import DeepSpeedAccumulator

                self.acc, self.model = DeepSpeedAccumulator(model), model
                return self.acc
            if self.constant_buffers:
                skip_buffer_sync(model)  # DDP's public attribute, not Accelerate's deprecated broadcast_buffers
            self.acc, self.model = MicrobatchAccumulator(model), model
            self.fsdp_modules = _fsdp_modules(model)
        return self.acc

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        acc = self.accumulator(model)
        step = self.trainer.state.global_step
        last = bool(self.trainer.accelerator.sync_gradients)
        _resume_fsdp_reduction(self.fsdp_modules)
        with contextlib.ExitStack() as stack:
            if self.kind == "grpo":  # counted once TRL generated and prepared the microbatch: compute_loss opens it
                self.open_late = lambda n: stack.enter_context(acc.microbatch(weight=n, last=last))
            else:
                self.pending = _count(self.count(inputs), step)
                stack.enter_context(_microbatch(acc, self.pending, last))
            try:
                before = getattr(acc, "ledger", None)
                loss = self.original_training_step(model, inputs, num_items_in_batch)
                if self.open_late is not None:  # the same code on every rank: every rank raises here
                    raise GradaggError(f"step {step}: {type(self.trainer).__name__}.training_step did not call "
                                       "compute_loss: exact() could not count the microbatch")
            except GradaggError as exc:
                if last and self.trainer.is_deepspeed_enabled:  # the window refused in engine.step(), every rank
                    self.window_loss = None
                    raise _stopped(exc, step) from exc
                raise
            finally:
                self.pending, self.open_late = None, None
        part = loss.detach().float() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self.window_loss = part if self.window_loss is None else self.window_loss + part
        device = self.trainer.args.device
        if not last:
            return torch.zeros((), device=device)
        if self.trainer.is_deepspeed_enabled:
            ledger = _deepspeed_ledger(acc, before, step)
        else:
            try:
                ledger = acc.finish()  # refuses on every rank a count that cannot count (negative, NaN, infinite)
            except GradaggError as exc:
                self.close()  # the window is dropped here, on every rank (the accumulator's advice to discard())
                raise _stopped(exc, step) from exc
        self.finished = True
        # The Trainer logs the mean over ranks of what the window's steps returned: each rank returns its share
        # of the global token mean times the number of ranks, so that the mean over ranks is the token mean.
        total, self.window_loss = self.window_loss, None
        if not ledger.weight_global:
            return torch.zeros((), device=device)
        return (total * (ledger.world_size / ledger.weight_global)).to(device)

    def close(self) -> None:
        """Give the model its own synchronisation back and unregister the accumulator (end of train(), failure)."""
        if self.acc is not None:
            self.acc.close()
        self.acc, self.model, self.window_loss, self.finished = None, None, None, False
        self.fsdp_modules = []

    def loss_func(self, outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        """The trainer's ``compute_loss_func``, given the microbatch's own count as ``num_items_in_batch``.

        transformers passes the count its loss divides by (the window's tokens); under :func:`exact` the loss must
        be the microbatch's mean over its count, so that count is passed: a loss written ``sum / num_items_in_batch``
        (or ``/ (num_items_in_batch or 1)``) and one that ignores it and returns its mean give the same value.
        """
        n = self.pending
        if n is None:  # evaluation: transformers' own count
            return self.user_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)  # type: ignore[misc]
        count = torch.tensor(int(n) if float(n).is_integer() else n, device=self.trainer.args.device)
        return self.user_loss_func(outputs, labels, num_items_in_batch=count)  # type: ignore[misc]

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if self.open_late is not None:
            return self.grpo_loss(model, inputs)
        n = self.pending
        if n is None:  # evaluation (prediction_step) or a call outside training_step: the Trainer's own loss
            return self.original_compute_loss(model, inputs, return_outputs=return_outputs,
                                              num_items_in_batch=num_items_in_batch)
        out = self.original_compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=None)
        loss, rest = (out[0], out[1:]) if return_outputs else (out, ())
        summed = loss * n if 0 < n < math.inf else _zero_loss(loss)  # NaN and the rest: refused in finish()
        return (summed, *rest) if return_outputs else summed

    def grpo_loss(self, model: Any, inputs: Any) -> Any:
        """GRPO's microbatch, opened here with its count: TRL's loss times TRL's divisor, the mode's numerator."""
        from gradagg.integrations._grpo import grpo_count

        divisor, weight = grpo_count(self.trainer, inputs)
        open_microbatch, self.open_late = self.open_late, None
        open_microbatch(weight)  # type: ignore[misc]  # a 0-dim tensor: the accumulator reads it at finish()
        return self.original_compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None) * divisor


def _microbatch(acc: Any, weight: float, last: bool) -> Any:
    """The accumulator's microbatch; DeepSpeed's window closes at ``engine.step()`` instead of a ``last`` mark."""
    from gradagg.torch import MicrobatchAccumulator

    if isinstance(acc, MicrobatchAccumulator):
        return acc.microbatch(weight=weight, last=last)
    return acc.microbatch(weight=weight)


def _deepspeed_ledger(acc: Any, before: Any, step: int) -> Any:
    """The window's ledger under DeepSpeed: Accelerate's backward of the sync microbatch ran ``engine.step()``,
    which finished the window (before DeepSpeed's clip and optimizer step); refused if it did not."""
    if acc.ledger is None or acc.ledger is before:
        raise GradaggError(f"step {step}: the Trainer's last microbatch of the window did not run engine.step() "
                           "(Accelerate's DeepSpeed backward with sync_gradients): the window was not finished")
    return acc.ledger


def _stopped(exc: GradaggError, step: int) -> GradaggError:
    reason = exc.reason if isinstance(exc, WindowError) else str(exc)
    return type(exc)(f"step {step}: exact() could not finish the Trainer's accumulation window: {reason}; train() "
                     "stops without stepping")


def _no_count(inputs: Mapping[str, Any]) -> object:
    raise AssertionError("GRPO's microbatches are counted in compute_loss")


def _fsdp_modules(model: Any) -> list[Any]:
    """The ``FSDPModule`` instances in ``model`` (none under DDP): walked once, not at every microbatch."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _resume_fsdp_reduction(fsdp_modules: list[Any]) -> None:
    """Undo the Trainer's FSDP2 deferral for this microbatch: gradagg reduce-scatters every microbatch itself.

    For a model sharded at load time (``from_pretrained(distributed_config=...)``) the Trainer runs every
    microbatch but the window's last inside its own deferral, which calls ``set_requires_gradient_sync(False)``
    on the model: the shards would then stay unreduced in ``.grad``, which the accumulator refuses. Turned back
    on here, inside that context, through the public ``FSDPModule`` method, as the accumulator configured it.
    """
    for module in fsdp_modules:
        module.set_requires_gradient_sync(True, recurse=False)


def _zero_loss(loss: Any) -> Any:
    """A zero that back-propagates into no parameter: a microbatch counting no token (its mean may be 0/0).

    Not a leaf: DeepSpeed's ``engine.backward`` refuses a loss without a ``grad_fn``."""
    return torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True).clone()


def _count(value: object, step: int) -> float:
    """A microbatch's count as a float. Not a number: refused here (the same on every rank, the same code runs
    there). Negative, NaN or infinite: handed to the accumulator as it is, whose ``finish()`` refuses it on
    every rank (refused here, on one rank only, it would leave the others waiting in the window's reduction)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GradaggError(
            f"step {step}: the microbatch's count must be a non-negative number or 0-dim tensor, got "
            f"{type(value).__name__} {value!r}"
        )
    try:
        return float(value)
    except OverflowError:  # an int beyond float64: refused by finish() as infinite
        return math.inf


@contextlib.contextmanager
def _no_sync_held(model: Any = None) -> Iterator[None]:
    """``accelerator.no_sync`` under :func:`exact`: the accumulator already holds DDP's and FSDP2's reduction."""
    yield


class _FinishedGuard(TrainerCallback):  # type: ignore[misc]
    """Refuses an optimizer step whose window gradagg did not finish (a loop that did not mark its last microbatch)."""

    def __init__(self, hold: _Exact) -> None:
        self.hold = hold

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hold.kind is not None:
            check_even_microbatches(self.hold.trainer, kwargs.get("train_dataloader"))
        else:
            _check_even_steps(self.hold.trainer, kwargs.get("train_dataloader"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.hold.close()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.hold.finished:
            raise GradaggError(
                f"step {state.global_step}: the optimizer steps before gradagg finished the accumulation window "
                "(the Trainer did not mark the window's last microbatch with accelerator.sync_gradients); the "
                "gradient would be unreduced and its clip skipped"
            )
        self.hold.finished = False


def _check_even_steps(trainer: Any, loader: Any) -> None:
    """Refuse, on every rank, a Trainer whose ranks would run different numbers of optimizer steps per epoch.

    Each optimizer step's ``finish()`` is a collective over every rank: a rank with a step more would wait in it
    for the others, which would have gone on to their next epoch (or ended ``train()``), and their next window's
    collectives would pair with it. The Trainer counts an epoch's steps from its rank's own loader (Accelerate's
    ``even_batches=False`` deals the batches out in turn): ``ceil(len(loader) / gradient_accumulation_steps)``.
    The ranks' lengths are gathered once, here, before the first microbatch (every rank reaches
    ``on_train_begin``). Ranks that run different numbers of microbatches in as many steps are exact (a window's
    counts may differ per rank). A loader without a length is refused with ``even_batches=False``, or beside ranks
    whose loaders have one: its epochs cannot be compared (:func:`uneven_steps`).

    Raises:
        GradaggError: on every rank, naming each rank's steps and microbatches per epoch.
    """
    from gradagg.torch.collectives import all_gather_object, get_world_size

    if get_world_size() < 2:
        return
    window = trainer.args.gradient_accumulation_steps
    try:
        length: int | None = len(loader)
    except TypeError:  # an IterableDataset's loader (or none): no length
        length = None
    every: list[Any] = all_gather_object(length)
    counts = uneven_steps(every, window, bool(getattr(trainer.accelerator, "even_batches", True)))
    if counts is not None:
        raise GradaggError(
            f"exact() cannot train this {type(trainer).__name__} on ranks with different numbers of optimizer steps "
            f"per epoch ({counts}; gradient_accumulation_steps={window}): every step's finish() is a collective "
            "over all ranks, and a rank with a step more would meet the others' next window; keep Accelerate's "
            "even_batches=True (accelerator_config), or give every rank as many batches"
        )


def uneven_steps(lengths: list[int | None], window: int, even_batches: bool) -> str | None:
    """Each rank's optimizer steps and microbatches per epoch, where the ranks would not run as many steps; else None.

    A rank's steps: ``max(ceil(length / window), 1)``, as transformers counts them (``set_initial_training_values``).
    Lengths not known (None): uneven with ``even_batches=False``, or where other ranks' are known (a mix cannot be
    compared); on every rank with ``even_batches=True``, every rank runs ``max_steps`` (Accelerate evens the batches).

    >>> uneven_steps([4, 3], 3, False)
    'rank 0: 2 step(s) of 4 microbatch(es), rank 1: 1 step(s) of 3 microbatch(es)'
    >>> uneven_steps([5, 4], 3, False) is None
    True
    """
    steps = [None if n is None else max(-(-n // window), 1) for n in lengths]
    if len(set(steps)) > 1 or (None in steps and not even_batches):
        return ", ".join(f"rank {r}: {'unknown' if n is None else f'{k} step(s) of {n} microbatch(es)'}"
                         for r, (k, n) in enumerate(zip(steps, lengths)))
    return None


def _check_trainer(trainer: Any) -> None:
    if not isinstance(trainer, Trainer):
        raise GradaggError(f"exact() takes a transformers.Trainer, got {type(trainer).__name__}")
    if getattr(trainer, _MARK, None) is not None:
        raise GradaggError(f"exact() was already applied to this {type(trainer).__name__}; call it once")
    if _already_trained(trainer):
        raise GradaggError(
            f"exact() must be called before train(): this {type(trainer).__name__} already trained "
            f"(global step {trainer.state.global_step}, model wrapped as {type(trainer.model_wrapped).__name__})"
        )
    if not hasattr(trainer, "loss_is_scaled_for_ga"):
        raise GradaggError("exact() needs a transformers Trainer with loss_is_scaled_for_ga (transformers >= 5.24)")


def _already_trained(trainer: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    # transformers' own FSDP2 (a model sharded at load time by ``from_pretrained(distributed_config=...)``) is an
    # FSDPModule before training; Accelerate's FSDP2 makes it one only in train()
    native = bool(getattr(trainer, "is_distributed_loading_by_transformers", False))
    wrapped = trainer.model_wrapped is not trainer.model or (isinstance(trainer.model, FSDPModule) and not native)
    return bool(trainer.state.global_step > 0 or wrapped)


def _check_setup(trainer: Any) -> None:
    name = type(trainer).__name__
    reasons = []
    if trainer.is_deepspeed_enabled:
        reasons.extend(_deepspeed_problems(trainer))
    if trainer.args.n_gpu > 1:
        reasons.append(f"DataParallel over {trainer.args.n_gpu} GPUs (launch one process per GPU instead)")
    if max(trainer.get_tp_size(), trainer.get_cp_size(), trainer.get_sp_size()) > 1:
        reasons.append("tensor, context or sequence parallelism")
    if getattr(trainer, "aux_loss_enabled", False):
        reasons.append("a MoE router auxiliary loss (a per-microbatch mean, not a token sum)")
    if reasons:
        raise GradaggError(f"exact() cannot make this {name} exact: {'; '.join(reasons)}")


def _deepspeed_problems(trainer: Any) -> list[str]:
    """What :class:`~gradagg.integrations.deepspeed.DeepSpeedAccumulator` would refuse of the engine the Trainer will
    build (ZeRO stage, precision), read from its DeepSpeed config at ``exact()`` rather than met at the first step;
    TRL trainers, untested under DeepSpeed."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    stage = int(plugin.zero_stage)
    config = plugin.hf_ds_config
    problems = []
    if stage not in (1, 2, 3):
        problems.append(f"DeepSpeed ZeRO stage {stage} (gradagg needs ZeRO stage 1, 2 or 3: its "
                        "coalesce_grad_reduction, which keeps a window's gradients local, needs one)")
    if config.is_true("fp16.enabled") or getattr(trainer.args, "fp16", False):
        problems.append("DeepSpeed with fp16 (exact(engine) refuses DeepSpeed's fp16; use bf16 or float32)")
    if config.is_true("bf16.enabled") or getattr(trainer.args, "bf16", False):
        problems.extend(_deepspeed_bf16_problems(config))
    if check_trl(trainer) is not None:
        problems.append(f"a TRL {type(trainer).__name__} under DeepSpeed (not tested)")
    return problems


def _deepspeed_bf16_problems(config: Any) -> list[str]:
    """The bf16 settings :func:`gradagg.integrations.deepspeed.exact` refuses, as the Trainer's config writes them:
    a ``data_types.grad_accum_dtype`` other than bf16 (ZeRO-1 then runs DeepSpeed's ``BF16_Optimizer``, which cannot
    keep a window's gradients local; gradagg sums the window in float32 itself), ``bf16.check_grad_overflow`` false
    (DeepSpeed would apply a non-finite step)."""
    problems = []
    accum = config.get_value("data_types.grad_accum_dtype")
    if accum is not None and str(accum).removeprefix("torch.") not in ("bf16", "bfloat16"):
        problems.append(f"DeepSpeed bf16 with data_types.grad_accum_dtype {accum!r} (leave it unset: exact() keeps "
                        "the window's sum in float32 itself)")
    if config.is_false("bf16.check_grad_overflow"):
        problems.append("DeepSpeed bf16 with bf16.check_grad_overflow false (leave it true, DeepSpeed's default: it "
                        "skips a step with non-finite gradients on every rank)")
    return problems


def _default_weight(trainer: Any) -> Weight:
    """The causal shift's label count, for a model whose loss is transformers' ``ForCausalLM`` loss."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    if trainer.compute_loss_func is not None:
        raise GradaggError(
            "exact() cannot count the tokens of a compute_loss_func's loss: pass weight=fn, fn(inputs) giving the "
            "count the loss is a mean over (exact() passes it to the compute_loss_func as num_items_in_batch)"
        )
    model = trainer.accelerator.unwrap_model(trainer.model)
    loss = getattr(model, "loss_function", None)  # what the model's forward computes its loss with
    config = getattr(model, "config", None)
    if loss is not ForCausalLMLoss or getattr(config, "is_encoder_decoder", False):
        raise GradaggError(
            f"exact() counts a causal LM's shifted labels by default, but {type(model).__name__}'s loss is "
            f"{getattr(loss, '__name__', loss)!r}: pass weight=fn, fn(inputs) giving the count its loss is a mean over"
        )
    return lambda inputs: label_tokens(inputs, "a training microbatch")


def _constant_buffers(trainer: Any) -> bool:
    """Whether DDP may skip its buffer sync: every buffer is non-persistent and the user did not ask for one."""
    if getattr(trainer.accelerator, "ddp_handler", None) is None or trainer.args.ddp_broadcast_buffers is not None:
        return False
    model = trainer.model
    kept = set(model.state_dict(keep_vars=True))
    return all(name not in kept for name, _ in model.named_buffers())


__all__ = ["Weight", "exact"]
