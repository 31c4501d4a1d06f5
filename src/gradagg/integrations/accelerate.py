"""Exact accumulation in a Hugging Face Accelerate loop: ``acc = exact(accelerator, model, optimizer)``.

Accelerate's own recipe (``with accelerator.accumulate(model): accelerator.backward(model(**b).loss)``) averages
the microbatch means and divides every backward by ``gradient_accumulation_steps``, the short last window of an
epoch included. With the accumulator returned here the loop back-propagates each microbatch's *summed* loss::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    acc = exact(accelerator, model, optimizer)
    for batch in loader:
        with accelerator.accumulate(model):
            with acc.microbatch(weight=n_tokens(batch)):
                accelerator.backward(loss_sum(model, batch))   # or loss_sum(...).backward()
            if accelerator.sync_gradients:                      # the window is finished here: exact gradient
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); optimizer.zero_grad()

What it changes, and why:

* **the division**: inside ``acc.microbatch()`` Accelerate's ``gradient_accumulation_steps`` reads 1 (its public
  setter, restored on exit), so ``accelerator.backward`` divides by nothing and a plain ``.backward()`` is exact
  too; the accumulator divides once, by the weights counted on all ranks.
* **the window**: it closes (``finish()``, one collective per bucket) at the end of the microbatch during which
  ``accelerator.sync_gradients`` is set, the step Accelerate's own counter or the end of its prepared dataloader
  chooses: so ``accelerator.clip_grad_norm_`` and the optimizer see the finished gradient. The optimizer is
  attached (``acc.attach``): a step over a window still held finishes it first.
* **the buffers**: Accelerate's DDP broadcasts them at its synchronised forwards; the accumulator keeps that
  meaning itself (DDP's forward sync off while it holds DDP, one broadcast from rank 0 per window, in ``finish()``).
* one ``acc.microbatch()`` per ``accelerator.accumulate()`` block, inside it: an ``accumulate()`` entered inside
  the microbatch would count with the divisor set to 1, and is refused.
* two optimizers over disjoint parameters (Muon beside AdamW), both prepared: ``exact(accelerator, model,
  [opt_a, opt_b])`` attaches both, and each steps on the window's exact gradient.

Under Accelerate's DeepSpeed plugin (ZeRO stage 1, 2 or 3, float32) ``exact`` returns a
:class:`~gradagg.integrations.deepspeed.DeepSpeedAccumulator` on the engine ``accelerator.prepare`` returned (pass it
as ``model``), and the same loop is exact with ``accelerator.backward(loss_sum)``: Accelerate calls ``engine.step()``
inside the backward of its sync microbatch, which closes the window there; DeepSpeed clips the exact gradient
(``gradient_clipping`` in its config) and ``accelerator.clip_grad_norm_`` returns the norm it measured. A plain
``loss_sum.backward()`` bypasses the engine and is wrong there. ZeRO-3 needs as many microbatches on every rank
(Accelerate's default ``even_batches``). bf16 (``mixed_precision="bf16"``) is exact within bf16's round-off; fp16,
ZeRO stage 0 and Megatron-LM are refused.

Under its FSDP plugin with ``fsdp_version=1`` ``model`` is the FSDP1 module ``prepare`` built: the same loop is exact
(:mod:`gradagg.torch.accumulate.wrappers.fsdp1`; ``accelerator.clip_grad_norm_`` is then FSDP1's own clip, on the
finished gradient).

Accelerate is imported by the caller; this module imports it only for type names, lazily.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.integrations.deepspeed import DeepSpeedAccumulator
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.accumulate.terms_after import Microbatch


class AcceleratedAccumulator(MicrobatchAccumulator):
    """A :class:`~gradagg.torch.MicrobatchAccumulator` whose windows follow ``accelerator.sync_gradients``.

    Made by :func:`exact`; see the module's docstring for the loop.
    """

    _undoes_division = True  # gradient_accumulation_steps reads 1 inside microbatch(): attach() accepts it

    def __init__(self, accelerator: Any, model: torch.nn.Module, **options: Any) -> None:
        super().__init__(model, **options)
        self._accelerator = accelerator

    @contextlib.contextmanager
    def microbatch(self, weight: object = None, *, last: bool = False) -> Iterator[Microbatch]:
        """One microbatch, as :meth:`MicrobatchAccumulator.microbatch`; the window closes after it when
        ``accelerator.sync_gradients`` is set.

        Raises:
            WindowError: ``accelerator.accumulate()`` was entered inside this microbatch.
        """
        acc = self._accelerator
        step = acc.step
        with _undivided(acc), super().microbatch(weight, last=last or bool(acc.sync_gradients)) as mb:
            yield mb
        if acc.step != step:
            raise WindowError(
                "accelerator.accumulate() was entered inside acc.microbatch(): enter acc.microbatch() inside "
                "`with accelerator.accumulate(model):`, once per block"
            )
        if acc.sync_gradients:
            self.finish()


@contextlib.contextmanager
def _undivided(accelerator: Any) -> Iterator[None]:
    """``accelerator.backward`` divides by ``gradient_accumulation_steps``: 1 for the duration, restored after."""
    steps = accelerator.gradient_accumulation_steps
    accelerator.gradient_accumulation_steps = 1
    try:
        yield
    finally:
        accelerator.gradient_accumulation_steps = steps


def exact(accelerator: Any, model: torch.nn.Module, optimizer: Any,
          **options: Any) -> AcceleratedAccumulator | DeepSpeedAccumulator:
    """The accumulator for a loop that ``accelerator`` prepared: its windows, its divisor, its optimizer's step.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        model: the model ``accelerator.prepare`` returned (a ``DistributedDataParallel`` module under several
            processes; the ``DeepSpeedEngine`` under its DeepSpeed plugin; the FSDP1 module under its FSDP plugin
            with ``fsdp_version=1``, its ``accumulate()`` entering FSDP1's ``no_sync()`` between syncs (tested with
            Accelerate's state set as on a GPU: on a CPU machine Accelerate gives DDP instead); FSDP2-sharded under
            ``fsdp_version=2``, untested).
        optimizer: the ``AcceleratedOptimizer`` that ``accelerator.prepare`` returned, or a list of them over
            disjoint parameters (Muon beside AdamW, a GAN's two): each is attached; the window's first step (or
            clip) finds it finished, and the others step on the same gradients.
        **options: passed to :class:`~gradagg.torch.MicrobatchAccumulator` (``nonfinite``, ``bucket_mb``, ...);
            none under DeepSpeed.

    Returns:
        An :class:`AcceleratedAccumulator` (a :class:`~gradagg.integrations.deepspeed.DeepSpeedAccumulator`
        under DeepSpeed); run each microbatch in its ``microbatch(weight=...)``.

    Raises:
        GradaggError: ``optimizer`` is not one ``accelerator.prepare`` returned (nor a non-empty list of them); two
            optimizers sharing a parameter (naming both); under DeepSpeed, ``model`` not
            its engine, options given, or what :func:`gradagg.integrations.deepspeed.exact` refuses (ZeRO stage 0,
            fp16, some bf16 configs, pipeline or tensor parallelism); Megatron-LM, which runs its own backward and
            accumulation; several processes in the environment but no
            process group (Accelerate without ``cpu=True`` on a CPU machine under ``torchrun``: the accumulator's
            own check, see :func:`gradagg.torch.collectives.check_launcher_world`).
    """
    _check_accelerator(accelerator)
    if "DEEPSPEED" in str(getattr(accelerator, "distributed_type", "")):
        return _deepspeed(model, options)
    optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
    for k, one in enumerate(optimizers):
        if not isinstance(getattr(one, "optimizer", None), torch.optim.Optimizer):
            where = f"optimizer[{k}]" if isinstance(optimizer, list | tuple) else "optimizer"
            raise GradaggError(
                f"exact(accelerator, model, optimizer): {where} is a {type(one).__name__}, not the "
                "AcceleratedOptimizer that accelerator.prepare returned"
            )
    if not optimizers:
        raise GradaggError("exact(accelerator, model, optimizer): optimizer is an empty list; give the prepared ones")
    acc = AcceleratedAccumulator(accelerator, model, **options)
    try:
        for one in optimizers:  # a step over a window still held finishes it first (removed by close())
            acc.attach(one)
    except BaseException:
        acc.close()  # an overlap refused: the accumulator holds no parameter after the error
        raise
    return acc


def _check_accelerator(accelerator: Any) -> None:
    kind = str(getattr(accelerator, "distributed_type", ""))
    if "MEGATRON" in kind:
        raise GradaggError(f"exact(accelerator, ...): {kind} runs its own backward and accumulation; not supported")


def _deepspeed(engine: Any, options: dict[str, Any]) -> DeepSpeedAccumulator:
    """The accumulator on the engine Accelerate prepared; its ``gradient_accumulation_steps`` may stay Accelerate's:
    the engine steps only where Accelerate calls ``engine.step()``, once per window, on its sync microbatch."""
    where = "exact(accelerator, model, optimizer) under DeepSpeed"
    if options:
        raise GradaggError(f"{where}: options {sorted(options)} apply to the DDP/FSDP accumulator, not DeepSpeed's")
    if not hasattr(engine, "coalesce_grad_reduction"):
        raise GradaggError(f"{where}: model is a {type(engine).__name__}, not the DeepSpeedEngine (0.19+) that "
                           "accelerator.prepare returned")
    try:
        return DeepSpeedAccumulator(engine)
    except GradaggError as exc:
        raise GradaggError(f"{where}: {exc}") from exc


__all__ = ["AcceleratedAccumulator", "exact"]
