"""torchtitan's training step, with its prefetch of the window replaced by counting tokens as the window runs.

torchtitan 0.3.0's ``Trainer.train_step`` is exact: it first fetches every microbatch of the optimizer step, counts
their valid tokens, all-reduces the count, and only then runs the forwards, each loss divided by that global count.
The prefetch holds the whole window's data before the first forward and costs a collective before any compute
(pytorch/torchtitan#2850; #4398's review asks for "train-microbatch-as-you-go"). ``ExactTrainer`` runs each
microbatch as soon as it is fetched, back-propagates the *summed* loss and gives the accumulator the microbatch's
count; ``finish()`` divides by the global count, summed in the same collective as the gradients, and the clip
then sees the exact gradient. The window may end early when the data does, on any rank: that last window is
exact too, and training ends after it (torchtitan drops such a window).

Data parallelism only (FSDP2 or HSDP, either SPMD DTensor backend, activation checkpointing and its default
``zero_grad`` included); tensor, context and pipeline parallelism count a microbatch on several ranks and are refused.

Run it as torchtitan's own ``train.py`` is run, e.g.
    torchrun --nproc-per-node 8 examples/torchtitan_exact.py --module llama3 --config llama3_debugmodel
on torchtitan's GPU stack: CUDA GPUs, torchtitan and triton (its models import triton). Run as a script where one
of these is missing, it says which in one line on stderr before importing torchtitan, and exits 2.
tests/integrations/test_torchtitan.py runs :func:`exact_train_step` on CPU gloo ranks, with the shims of
tests/integrations/workers/titan_model.py.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable, Iterator
from functools import partial

import torch


def missing_gpu_stack() -> list[str]:
    """What torchtitan's trainer needs here and does not find: CUDA, torchtitan, triton."""
    missing = [] if torch.cuda.is_available() else ["a CUDA GPU"]
    return missing + [name for name in ("torchtitan", "triton") if importlib.util.find_spec(name) is None]


if __name__ == "__main__" and missing_gpu_stack():  # before torchtitan's imports, which fail without triton
    print(f"torchtitan_exact.py: needs torchtitan's GPU stack, and this machine lacks {', '.join(missing_gpu_stack())}"
          " (on a CPU, tests/integrations/test_torchtitan.py runs this step with CPU shims)", file=sys.stderr)
    sys.exit(2)

from torchtitan.components.dataloader import DataloaderExhaustedError  # noqa: E402
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from gradagg.errors import GradaggError, WindowError  # noqa: E402
from gradagg.torch import Ledger, MicrobatchAccumulator  # noqa: E402

Microbatch = tuple[dict[str, torch.Tensor], torch.Tensor]


def accumulator_for(trainer: Trainer) -> MicrobatchAccumulator:
    """The trainer's accumulator, made on first use (after ``parallelize``: it reads the FSDP2 layout it finds)."""
    acc = getattr(trainer, "gradagg_accumulator", None)
    if acc is None:
        dims = trainer.parallel_dims
        if dims.tp_enabled or dims.cp_enabled or dims.pp_enabled or dims.ep_enabled:
            raise GradaggError("torchtitan_exact: data parallelism only (FSDP2/HSDP); tensor, context, pipeline and "
                               "expert parallelism run one microbatch on several ranks, which would count it twice")
        acc = MicrobatchAccumulator(trainer.model_parts[0], pad=partial(pad, trainer))
        trainer.gradagg_accumulator = acc  # type: ignore[attr-defined]
    return acc


def pad(trainer: Trainer) -> torch.Tensor:
    """The padding microbatch of a rank whose data ran out while others still run one (FSDP2 needs every rank in
    each round's collectives; gradagg drops its gradients): this rank's last microbatch through torchtitan's own
    forward and loss. Not the default replay of the model's forward alone: torchtitan's ChunkedLossWrapper runs
    ``lm_head`` inside the loss, so a forward alone would leave lm_head's FSDP collectives out and the ranks hang."""
    last = getattr(trainer, "gradagg_last_microbatch", None)
    if last is None:
        raise GradaggError("torchtitan_exact: this rank ran out of data before its first microbatch, so it has no "
                           "batch to pad with while the other ranks still run one; give every rank data")
    input_dict, labels = last
    seen = trainer.ntokens_seen  # post_dataloading_process counts the tokens: a padding batch is not seen
    inputs, labels, extra = trainer.post_dataloading_process(dict(input_dict), labels)
    trainer.ntokens_seen = seen
    with trainer.train_context():
        loss, _ = trainer.loss_fn(trainer.model_parts[0](inputs, **extra), labels, _one(trainer))
    return loss  # type: ignore[no-any-return]


def _one(trainer: Trainer) -> torch.Tensor:
    return torch.ones((), dtype=torch.int64, device=trainer.device)  # a divisor of 1: the loss stays a sum


def window(data_iterator: Iterator[Microbatch], size: int) -> Iterable[Microbatch]:
    """Up to ``size`` microbatches, fewer when the data ends (torchtitan's iterator raises at its end)."""
    for _ in range(size):
        try:
            yield next(data_iterator)
        except DataloaderExhaustedError:
            return


def exact_train_step(trainer: Trainer, data_iterator: Iterator[Microbatch]) -> torch.Tensor:
    """One optimizer step of ``trainer``: the global token mean's gradient, clipped, then the optimizer's step.

    Returns:
        The gradient's norm before clipping (what torchtitan logs as ``grad_norm``).

    Raises:
        DataloaderExhaustedError: the previous window ended with the data, or this one found none on any rank
            (torchtitan then ends training).
    """
    if getattr(trainer, "gradagg_data_ended", False):
        raise DataloaderExhaustedError()
    acc = accumulator_for(trainer)
    # torchtitan's own zero_grad: set_to_none=False while CUDA graphs are on (the gradients then stay allocated).
    trainer.optimizers.zero_grad(set_to_none=trainer.config.training.disable_cuda_graphs)
    loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
    for input_dict, labels in acc.microbatches(window(data_iterator, trainer.gradient_accumulation_steps)):
        with acc.microbatch(weight=(labels != IGNORE_INDEX).sum()):
            inputs = {k: v.to(trainer.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            labels = labels.to(trainer.device)
            trainer.gradagg_last_microbatch = (inputs, labels)  # type: ignore[attr-defined]
            loss = trainer.forward_backward_step(input_dict=inputs, labels=labels, global_valid_tokens=_one(trainer))
        loss_sum += _local(loss.detach()).double()
    ledger = _finish(acc)  # every .grad: the sum over the window's microbatches on all ranks / their token count
    grad_norm: torch.Tensor = dist_utils.clip_grad_norm_(
        [p for m in trainer.model_parts for p in m.parameters()], trainer.config.training.max_norm, foreach=True,
        pp_mesh=trainer.parallel_dims.get_optional_mesh("pp"), ep_enabled=trainer.parallel_dims.ep_enabled)
    trainer.checkpointer.maybe_wait_for_staging()
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    # Every rank reads the same per-rank counts, so every rank ends training after the same (short) window.
    short = min(ledger.microbatches_per_rank or (0,)) < trainer.gradient_accumulation_steps
    trainer.gradagg_data_ended = short  # type: ignore[attr-defined]
    _log(trainer, loss_sum, ledger.weight_local or 0.0, float(ledger.divisor or 1.0), grad_norm)
    return grad_norm


def _finish(acc: MicrobatchAccumulator) -> Ledger:
    """``acc.finish()``; a window in which no rank had data left is the data's end, as in torchtitan."""
    ran_none = acc.ledger.microbatches_local == 0
    try:
        return acc.finish()
    except WindowError as exc:
        # M = 0 is known on every rank from the same collective, so every rank ends here together.
        if ran_none and "(M = 0)" in str(exc):
            raise DataloaderExhaustedError() from None
        raise


def _local(loss: torch.Tensor) -> torch.Tensor:
    """This rank's part of the loss: under full_dtensor the loss is a DTensor (Partial over the batch)."""
    return loss.to_local() if hasattr(loss, "to_local") else loss  # type: ignore[no-any-return]


def _log(trainer: Trainer, loss_sum: torch.Tensor, tokens: float, total: float, grad_norm: torch.Tensor) -> None:
    """torchtitan's metrics: the window's true token mean (its global_avg_loss) and the largest rank mean."""
    if not trainer.metrics_processor.should_log(trainer.step):
        return
    mesh = trainer.parallel_dims.get_optional_mesh("loss")
    mean = float(dist_utils.dist_sum(loss_sum / total, mesh)) if mesh is not None else float(loss_sum) / total
    rank_mean = loss_sum / tokens if tokens else torch.zeros_like(loss_sum)
    largest = float(dist_utils.dist_max(rank_mean, mesh)) if mesh is not None else float(rank_mean)
    trainer.metrics_processor.log(trainer.step, mean, largest, float(_local(grad_norm)),
                                  extra_metrics=trainer.lr_schedulers.get_metrics())


class ExactTrainer(Trainer):  # type: ignore[misc]
    """torchtitan's Trainer with :func:`exact_train_step` as its ``train_step``."""

    def train_step(self, data_iterator: Iterator[Microbatch]) -> None:  # type: ignore[override]
        exact_train_step(self, data_iterator)


def main() -> None:
    """torchtitan's ``train.py`` main, with :class:`ExactTrainer` in place of ``Trainer``."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args()
    trainer = ExactTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
