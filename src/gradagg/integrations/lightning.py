"""Exact accumulation under Lightning's automatic optimisation: ``Trainer(callbacks=[ExactAccumulation()])``.

Lightning's own accumulation divides every microbatch's loss by ``accumulate_grad_batches`` (the short last
window of an epoch included) and, with a mean loss, averages microbatch means. With this callback the
``training_step`` returns the microbatch's *summed* loss and what it counts for::

    def training_step(self, batch, batch_idx):
        return {"loss": loss_sum(self(batch), batch), "weight": n_tokens(batch)}

    trainer = Trainer(callbacks=[ExactAccumulation()], accumulate_grad_batches=3, gradient_clip_val=1.0)

(or ``ExactAccumulation(weight=fn)``, ``fn(batch, batch_idx)`` giving the count, and any ``training_step``
returning the summed loss). Every optimizer step's gradient is then the sum over all microbatches of all ranks
divided by their total weight, clipped by Lightning on that gradient. How, through Lightning's public hooks:

* ``on_before_backward`` opens the accumulator's microbatch and undoes Lightning's division at the root of the
  backward (a hook on the loss multiplies its gradient by ``accumulate_grad_batches``: ``k / k`` is exactly 1);
  ``on_after_backward`` closes it. The window's last microbatch is marked by Lightning's own rule (``k`` batches,
  or the epoch's last), so its backward already sends the complete gradient buckets (DDP's overlap).
* ``on_before_optimizer_step`` (after the closure that runs the window's last backward, before Lightning
  clips) calls ``finish()``: one collective per gradient bucket, the weights counted on all ranks.
* the weight comes from the dict ``training_step`` returns (read by a thin wrapper around it, installed
  for the fit and removed after), or from ``weight=fn``; its value is taken when it is given (a tensor is copied:
  one count tensor updated in place by every ``training_step`` counts each batch's own value).

* ``on_train_batch_start`` of a window's first batch zeroes the gradients (``optimizer.zero_grad()``), as
  Lightning does on the same batches but only after the forward: under FSDP1 the window opens in the root's
  forward (its ranks agree the round before FSDP1's all-gather), where the last step's gradients would still be
  there and be refused as stale.

Strategies: single device, ``DDPStrategy`` (the accumulator keeps DDP in ``no_sync``, and keeps its buffer
broadcast itself: one from rank 0 per window, in ``finish()``),
``ModelParallelStrategy`` with ``fully_shard`` applied in ``configure_model`` (FSDP2) and ``FSDPStrategy``
(FSDP1's shards form, on the root Lightning builds; Lightning refuses its own norm clip there: clip with the root's
``clip_grad_norm_`` in ``configure_gradient_clipping``). The ranks run as many batches as each other (Lightning
broadcasts from rank 0 at every batch), refused otherwise at each epoch's start; a rank with nothing to count gives
weight 0. Lightning is imported only when this module is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from gradagg.errors import GradaggError
from gradagg.torch import MicrobatchAccumulator

WeightFn = Callable[[Any, int], object]


class ExactAccumulation(Callback):
    """Make each optimizer step's gradient the global weighted mean over the step's microbatches.

    Args:
        weight: ``fn(batch, batch_idx)`` giving a microbatch's count (e.g. its valid tokens); None (default):
            ``training_step`` returns ``{"loss": summed_loss, "weight": count}``.
        **options: passed to :class:`~gradagg.torch.MicrobatchAccumulator` (``nonfinite``, ``bucket_mb``, ...).

    Raises:
        GradaggError: at fit start, manual optimisation or more than one optimizer; at an epoch's start, ranks
            with different numbers of batches (on every rank); during the fit, a ``training_step`` output without a
            ``"weight"`` (and no ``weight=fn``).
    """

    def __init__(self, weight: WeightFn | None = None, **options: Any) -> None:
        self._weight_fn = weight
        self._options = options
        self._acc: MicrobatchAccumulator | None = None
        self._weight: object = None
        self._open: contextlib.AbstractContextManager[object] | None = None
        self._batch_idx = -1

    @property
    def accumulator(self) -> MicrobatchAccumulator:
        """The fit's accumulator (its ``ledger`` is the last window's), once the fit started."""
        if self._acc is None:
            raise GradaggError("ExactAccumulation.accumulator: the fit has not started")
        return self._acc

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _check_fit(trainer, pl_module)
        model = trainer.strategy.model
        if model is None:
            raise GradaggError(f"ExactAccumulation: {type(trainer.strategy).__name__} has no model at fit start")
        self._acc = MicrobatchAccumulator(model, **self._options)
        # attached, so that the step (its closure runs the window's last backward) is known to finish the window;
        # on_before_optimizer_step finishes it already, inside that closure and before Lightning clips
        self._acc.attach(trainer.optimizers[0])
        if self._weight_fn is None:
            _wrap_training_step(pl_module, self._take_output)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _check_even_batches(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx
        if batch_idx % trainer.accumulate_grad_batches == 0:
            # Lightning zeroes the last step's gradients after this batch's forward (its closure runs
            # training_step, zero_grad, backward); a wrapper whose forward is a collective (FSDP1) opens the window
            # before that forward, where those gradients would be refused as stale. Zeroed here, as Lightning would
            # a moment later, on the same batches (Lightning's rule: the first of each window)
            trainer.optimizers[0].zero_grad()
        self._weight = None if self._weight_fn is None else _taken(self._weight_fn(batch, batch_idx))

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        acc = self.accumulator
        k = trainer.accumulate_grad_batches
        if k != 1:  # Lightning back-propagates loss / k: its gradient k / k = 1 gives the summed loss's
            loss.register_hook(lambda g: g * k)  # type: ignore[no-untyped-call]
        weight, self._weight = self._weight, None
        if weight is None:
            raise GradaggError(
                f"ExactAccumulation: batch {self._batch_idx} has no weight: return "
                '{"loss": summed_loss, "weight": n} from training_step, or pass ExactAccumulation(weight=fn)'
            )
        self._open = acc.microbatch(weight=weight, last=_steps_after(trainer, self._batch_idx))
        self._open.__enter__()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        opened, self._open = self._open, None
        if opened is not None:
            opened.__exit__(None, None, None)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.accumulator.finish()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        opened, self._open = self._open, None
        if opened is not None:  # a backward raised: the accumulator records the failed microbatch
            with contextlib.suppress(BaseException):
                opened.__exit__(type(exception), exception, exception.__traceback__)
        self._end(pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(pl_module)

    def _take_output(self, output: Any) -> None:
        if isinstance(output, dict) and "weight" in output:
            self._weight = _taken(output["weight"])

    def _end(self, pl_module: LightningModule) -> None:
        pl_module.__dict__.pop("training_step", None)
        if self._acc is not None:
            self._acc.close()  # DDP's buffer broadcast at each forward comes back with it
        self._acc = None


def _check_fit(trainer: Trainer, pl_module: LightningModule) -> None:
    if not pl_module.automatic_optimization:
        raise GradaggError(
            "ExactAccumulation needs automatic optimisation; under manual optimisation run the microbatches in "
            "gradagg.torch.MicrobatchAccumulator.microbatch() and call finish() before optimizer.step()"
        )
    if len(trainer.optimizers) != 1:
        raise GradaggError(f"ExactAccumulation supports one optimizer; configure_optimizers gave "
                           f"{len(trainer.optimizers)}")


def _check_even_batches(trainer: Trainer) -> None:
    """Refuse, on every rank, an epoch whose ranks would run different numbers of batches.

    Lightning broadcasts from rank 0 at every training batch (its SIGTERM check), under every strategy, and each
    window's ``finish()`` is a collective: a rank with a batch more would meet the others' next collectives, and
    the run would hang until the collective timeout. The ranks' counts (``num_training_batches``, from each rank's
    own loader) are gathered once per epoch, before its first batch, which every rank reaches.

    Raises:
        GradaggError: on every rank, naming each rank's batches.
    """
    from gradagg.torch.collectives import all_gather_object, get_world_size

    if get_world_size() < 2:
        return
    every = all_gather_object(trainer.num_training_batches)
    if len(set(every)) > 1:  # numbers: ints, or inf for a loader without a length
        counts = ", ".join(f"rank {r}: {n}" for r, n in enumerate(every))
        raise GradaggError(
            f"ExactAccumulation: the ranks would run different numbers of batches in epoch {trainer.current_epoch} "
            f"({counts}): Lightning broadcasts from rank 0 at every batch and each window's finish() is a "
            "collective, so a rank with a batch more would meet the others' next ones; give every rank as many "
            "batches (Lightning's DistributedSampler does), a rank with nothing to count batches of weight 0"
        )


def _taken(weight: object) -> object:
    """``weight``'s value now: a tensor is copied (on its device, no host sync), so that a count kept in one tensor
    and updated in place by the next ``training_step`` still counts this batch's value."""
    return weight.detach().clone() if isinstance(weight, torch.Tensor) else weight


def _steps_after(trainer: Trainer, batch_idx: int) -> bool:
    """Whether Lightning steps after this batch (its own rule: k batches accumulated, or the epoch's last batch),
    so that the accumulator sends complete buckets during this backward (DDP's overlap). Where the epoch's length
    is unknown (an iterable dataset) the last window is not marked: ``finish()`` then sends every bucket."""
    done = batch_idx + 1
    return done % trainer.accumulate_grad_batches == 0 or done == trainer.num_training_batches


def _wrap_training_step(pl_module: LightningModule, take: Callable[[Any], None]) -> None:
    """An instance attribute over the class's ``training_step`` (removed by ``_end``): Lightning looks the
    method up on the instance at each call, under DDP's forward redirection too."""
    original = pl_module.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        take(out)
        return out

    pl_module.__dict__["training_step"] = training_step


__all__ = ["ExactAccumulation"]
