"""TRL's ``GRPOTrainer`` under :func:`gradagg.integrations.transformers.exact`: its ``loss_type`` over the window.

TRL's ``compute_loss`` (public, the Trainer's) returns one microbatch's loss already divided by a count of TRL's
choosing: the microbatch's rows (``grpo``, ``dr_grpo``) or tokens (``bnpo``), times the window's length; for
``dapo`` and ``cispo`` the generation batch's global tokens rescaled to a window. gradagg calls it, multiplies the
loss back by exactly that divisor (:func:`grpo_count`, read from the microbatch TRL prepared), which leaves TRL's own
per-token objective (clipping, importance ratios, the ``beta`` KL term, masks) summed as the ``loss_type``'s
numerator, and weights the microbatch by the named mode's count of its completions
(:func:`gradagg.torch.modes.aggregate`). The accumulator then divides the window's sum, over every microbatch of
every rank, by the window's count: the ``loss_type`` aggregated over the optimizer step, whatever
``steps_per_generation``, ``gradient_accumulation_steps``, ``num_iterations`` and completion lengths per rank.

========  ========================  ==================================================================
loss      mode over the window      TRL 1.16 divides one microbatch's sum by
========  ========================  ==================================================================
grpo      seq-mean-token-mean       its rows x GA (the sum of its sequences' token means)
bnpo      token-mean                its tokens x GA ("local batch": here the window's, on all ranks)
dr_grpo   seq-mean-token-sum-norm   its rows x max_completion_length x GA
dapo      token-mean                generation batch's global tokens / ranks x GA / steps_per_generation
cispo     token-mean                as dapo
========  ========================  ==================================================================

``bnpo`` is documented by TRL as a token mean over the *local* batch, which "may slightly vary depending on the local
batch size, despite a constant effective batch size": that dependence on the split is what ``exact()`` removes, so
``bnpo`` is made the token mean over the window on all ranks, the same value as ``dapo``'s documented "global
accumulated batch" (keep TRL's own ``bnpo`` by not calling ``exact()``).
A completion that is fully masked (``mask_truncated_completions``) counts in no divisor (TRL counts it among the
rows for ``grpo`` and ``dr_grpo``). The divisors above are TRL's implementation, not its API: they are pinned to the
TRL versions in :data:`TESTED` and any other version is refused at ``exact()``, as are the configurations whose loss
is not one sum over tokens: the other loss types (``sapo``, ``vespo``, ``luspo``), an entropy bonus (a per-microbatch
mean added to the loss) and a MoE auxiliary loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradagg.errors import GradaggError

GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
TESTED = ("1.16.",)  # TRL versions whose GRPO divisors grpo_count() undoes (read from their _compute_loss)
MODES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
         "dapo": "token-mean", "cispo": "token-mean"}


def check_grpo(trainer: Any, version: str | None = None) -> None:
    """Refuse a ``GRPOTrainer`` whose loss :func:`grpo_count` cannot make exact.

    Args:
        trainer: the ``GRPOTrainer`` (or a subclass).
        version: TRL's version (default: the installed one).

    Raises:
        GradaggError: a TRL version other than :data:`TESTED`; a ``loss_type`` other than those of :data:`MODES`;
            an entropy bonus or a MoE auxiliary loss.
    """
    name = type(trainer).__name__
    if version is None:
        import trl

        version = str(trl.__version__)
    reasons = []
    if not version.startswith(TESTED):
        reasons.append(f"TRL {version} (exact() knows GRPO's divisors of TRL {', '.join(v + 'x' for v in TESTED)})")
    loss_type = getattr(trainer, "loss_type", None)
    if loss_type not in MODES:
        reasons.append(f"loss_type {loss_type!r} (supported: {', '.join(MODES)})")
    args = getattr(trainer, "args", None)  # GRPOConfig's public fields, as GRPOTrainer.__init__ reads them
    if getattr(args, "entropy_coef", 0.0) or getattr(args, "use_adaptive_entropy", False):
        reasons.append("an entropy bonus (entropy_coef: a per-microbatch token mean added to the loss)")
    if getattr(trainer, "aux_loss_enabled", False):
        reasons.append("a MoE router auxiliary loss (a per-microbatch mean added to the loss)")
    if reasons:
        raise GradaggError(f"exact() cannot make this {name} exact: {'; '.join(reasons)}")


def grpo_count(trainer: Any, inputs: Mapping[str, Any]) -> tuple[Any, Any]:
    """What TRL divided one microbatch's loss by, and the microbatch's weight in the ``loss_type``'s mode.

    Args:
        trainer: the ``GRPOTrainer``, checked by :func:`check_grpo`.
        inputs: the microbatch as TRL's ``_prepare_inputs`` gave it to ``compute_loss`` (``completion_mask``, and
            ``tool_mask``, ``num_items_in_batch`` where TRL puts them).

    Returns:
        ``(divisor, weight)``: ``compute_loss``'s value times ``divisor`` is the mode's numerator over the
        microbatch (:func:`gradagg.torch.modes.aggregate`'s ``Part.loss``), ``weight`` its ``Part.weight``.

    Raises:
        GradaggError: a microbatch without a ``completion_mask`` tensor (or ``num_items_in_batch`` for dapo, cispo).
    """
    import torch

    from gradagg.torch.modes import aggregate

    mask = inputs.get("completion_mask") if isinstance(inputs, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        keys = sorted(map(str, inputs)) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise GradaggError(f"a GRPO microbatch must hold a 2-dim 'completion_mask' tensor (keys: {keys})")
    if "tool_mask" in inputs:  # TRL's loss mask in multi-turn tool use
        mask = mask * inputs["tool_mask"]
    loss_type, ga = trainer.loss_type, trainer.current_gradient_accumulation_steps
    norm = float(trainer.max_completion_length) if loss_type == "dr_grpo" else None
    weight = aggregate(MODES[loss_type], torch.zeros(mask.shape, device=mask.device), mask, norm=norm).weight
    rows, tokens = mask.shape[0], mask.sum()
    if loss_type == "grpo":
        return rows * ga, weight
    if loss_type == "bnpo":
        return tokens.clamp(min=1.0) * ga, weight
    if loss_type == "dr_grpo":
        return rows * trainer.max_completion_length * ga, weight
    total = inputs.get("num_items_in_batch")  # dapo, cispo: the generation batch's tokens on all ranks
    if not isinstance(total, torch.Tensor):
        raise GradaggError(f"a GRPO microbatch of loss_type {loss_type!r} must hold TRL's 'num_items_in_batch'")
    per_window = total.clamp(min=1.0) / trainer.accelerator.num_processes
    return per_window * ga / trainer.args.steps_per_generation, weight


__all__ = ["GRPO", "MODES", "TESTED", "check_grpo", "grpo_count"]
