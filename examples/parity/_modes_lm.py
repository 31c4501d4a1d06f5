"""Each named mode of ``gradagg.torch.modes`` on the tiny language model of ``_token_lm``: its truth and steps.

The truth of a mode is its formula over the whole window in one process (float64), written out here
without gradagg: with n_s a sequence's valid tokens and S the sequences with any,

* token-mean: sum of token losses / sum n_s;
* seq-mean-token-mean: mean over S of (a sequence's token sum / n_s);
* seq-mean-token-sum: sum of token losses / |S|;
* seq-mean-token-sum-norm: sum of token losses / (|S| x NORM).

A right step (:func:`right_step`) backpropagates ``aggregate(mode, ...).loss`` of each microbatch inside
``acc.microbatch(weight=part.weight)``: the accumulator divides by the window's count on all ranks. The
wrong steps are the divisor mistakes of the RL trackers (gradagg issue 23), one function each.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _token_lm import IGNORE, LENGTH, VOCAB, all_reduce_grads, build_model, microbatches

from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.modes import aggregate

__all__ = ["build_model", "microbatches", "full_batch_loss_of", "right_step", "mean_of_microbatch_means_step",
           "generation_batch_count_step", "no_division_step"]

NORM = float(LENGTH)  # C of seq-mean-token-sum-norm: the padded length, as Dr. GRPO's max completion length


def token_losses(model: torch.nn.Module, microbatch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy, (rows, LENGTH), and the mask of valid tokens."""
    inputs, targets = microbatch
    logits = model(inputs).reshape(-1, VOCAB)
    loss = F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction="none")
    return loss.reshape(targets.shape), targets != IGNORE


def full_batch_loss_of(mode: str, model: torch.nn.Module, microbatches: list) -> torch.Tensor:
    """The truth of ``mode``: one forward over the whole window, the mode's formula written out."""
    loss, mask = token_losses(model, (torch.cat([x for x, _ in microbatches]), torch.cat([y for _, y in microbatches])))
    m = mask.to(loss.dtype)
    sums, n = (loss * m).sum(1), m.sum(1)
    keep = n > 0  # a fully masked sequence counts in no divisor
    if mode == "token-mean":
        return sums.sum() / n.sum()
    if mode == "seq-mean-token-mean":
        return (sums[keep] / n[keep]).mean()
    if mode == "seq-mean-token-sum":
        return sums.sum() / keep.sum()
    if mode == "seq-mean-token-sum-norm":
        return sums.sum() / (keep.sum().to(loss.dtype) * NORM)  # a float64 count: int64 x float is float32
    raise ValueError(f"no truth written for mode {mode!r}")


def _part(mode: str, model: torch.nn.Module, microbatch: tuple):  # noqa: ANN202
    loss, mask = token_losses(model, microbatch)
    return aggregate(mode, loss, mask, norm=NORM if mode == "seq-mean-token-sum-norm" else None)


def right_step(mode: str, model: torch.nn.Module, microbatches: list) -> None:
    """Right: each microbatch's part inside ``acc.microbatch(weight=part.weight)``; ``finish()`` divides once."""
    acc = MicrobatchAccumulator(model)
    for mb in acc.microbatches(microbatches):
        part = _part(mode, model, mb)
        with acc.microbatch(weight=part.weight):
            part.loss.backward()
    acc.finish()
    acc.close()


def _global(value: float) -> torch.Tensor:
    total = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(total)
    return total


def mean_of_microbatch_means_step(mode: str, model: torch.nn.Module, microbatches: list) -> None:
    """Wrong (TRL's grpo/bnpo, trl#3021): each microbatch's own mean, then the mean over the window's microbatches.

    Exact only where every microbatch has the same count; split-dependent everywhere else.
    """
    for mb in microbatches:
        part = _part(mode, model, mb)
        (part.loss / part.weight).backward()
    all_reduce_grads(model)
    count = _global(len(microbatches))
    for p in model.parameters():
        p.grad /= count


def generation_batch_count_step(mode: str, model: torch.nn.Module, microbatches: list) -> None:
    """Wrong (TRL's dapo normaliser, trl#5619): divided by the generation batch's count, not the step's window.

    With ``steps_per_generation`` twice ``gradient_accumulation_steps``, one generation batch feeds two optimizer
    steps; here the second step reuses the same rows (as ``num_iterations=2`` does), so the count is twice the
    window's and every gradient is exactly half the truth, in one process too.
    """
    local = sum(float(_part(mode, model, mb).weight) for mb in microbatches)
    generation_count = 2 * _global(local)
    for mb in microbatches:
        (_part(mode, model, mb).loss / generation_count).backward()
    all_reduce_grads(model)


def no_division_step(mode: str, model: torch.nn.Module, microbatches: list) -> None:
    """Wrong (Dr. GRPO's sum-vs-mean, verl#3741): the numerators summed over the window, never divided."""
    for mb in microbatches:
        _part(mode, model, mb).loss.backward()
    all_reduce_grads(model)
