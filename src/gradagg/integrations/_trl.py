"""Which TRL trainers :func:`gradagg.integrations.transformers.exact` makes exact, decided at ``exact()``.

A TRL trainer is recognised by the first class of its method resolution order that TRL defines (a user's subclass
of ``SFTTrainer`` is an ``SFTTrainer``; TRL's own subclasses, e.g. ``GKDTrainer(SFTTrainer)``, are themselves).
By class name and module, so that TRL is never imported here (``exact()`` on a plain ``Trainer`` stays TRL-free).

* ``SFTTrainer``: a causal LM's token mean; the default count is the shifted labels (:mod:`._tokens`).
* ``DPOTrainer``: the mean over the microbatch's *pairs* of a per-pair loss (``per_sequence_loss.mean()`` for each
  ``loss_type``); the default count is the pairs, half the rows of ``input_ids`` (the collator stacks the chosen
  then the rejected completions). The loss types that are not a per-pair mean are refused: ``sft`` (a token mean
  over the microbatch's chosen completions), ``aot`` and ``aot_unpaired`` (they sort the microbatch's pairs, so a
  pair's loss depends on the others in its microbatch).
* ``GRPOTrainer``: its ``loss_type`` over the window (:mod:`._grpo`); the count is the loss type's, read from the
  microbatch TRL prepared (its completions), so ``weight=`` is refused.
* Every other TRL trainer is refused, naming it: RLOO and the other online trainers divide their loss by
  their own counts over the generation batch (gathered across ranks), and their inputs before generation are
  prompts, so a ``weight=`` function would count the wrong thing; KTO estimates its KL term across the ranks'
  microbatch; the distillation, reward, ORPO, CPO, ... trainers are not tested here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gradagg.errors import GradaggError
from gradagg.integrations._grpo import GRPO, check_grpo

SFT = "trl.trainer.sft_trainer.SFTTrainer"
DPO = "trl.trainer.dpo_trainer.DPOTrainer"
# DPO's loss types whose microbatch loss is the mean of a per-pair loss
DPO_PER_PAIR = frozenset({"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                          "apo_zero", "apo_down", "discopop", "sigmoid_norm"})
_WHY_NOT = {
    "RLOO": "its loss is already divided by its own count over the generation batch, and the inputs a weight= "
            "function sees are the prompts, before generation",
    "KTO": "its KL term is estimated over every rank's microbatch at once (gathered), not per example",
}


def trl_trainer(trainer: Any) -> str | None:
    """The dotted name of the first TRL class in ``type(trainer)``'s MRO, or None for a trainer TRL did not define."""
    for cls in type(trainer).__mro__:
        if cls.__module__ == "trl" or cls.__module__.startswith("trl."):
            return f"{cls.__module__}.{cls.__qualname__}"
    return None


def check_trl(trainer: Any) -> str | None:
    """Refuse a TRL trainer that :func:`exact` does not make exact; return its kind ("sft", "dpo", "grpo") or None.

    Raises:
        GradaggError: any TRL trainer but ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer``, naming it; a
            ``DPOTrainer`` whose ``loss_type`` is not a per-pair mean; a ``GRPOTrainer`` that
            :func:`._grpo.check_grpo` refuses.
    """
    found = trl_trainer(trainer)
    if found is None:
        return None
    if found == SFT:
        return "sft"
    if found == DPO:
        _check_dpo(trainer)
        return "dpo"
    if found == GRPO:
        check_grpo(trainer)
        return "grpo"
    base = found.rsplit(".", 1)[1]
    short = base.removesuffix("Trainer")
    why = next((text for key, text in _WHY_NOT.items() if key in short.upper()), None)
    raise GradaggError(
        f"exact() cannot make this {type(trainer).__name__} exact: {short} is not yet supported ({found}"
        + (f": {why}" if why else "") + "); exact() supports TRL's SFTTrainer, DPOTrainer and GRPOTrainer"
    )


def _check_dpo(trainer: Any) -> None:
    types = list(getattr(trainer, "loss_types", None) or [])
    bad = [t for t in types if t not in DPO_PER_PAIR]
    if bad or not types:
        raise GradaggError(
            f"exact() cannot make this {type(trainer).__name__} exact: loss_type {bad or types!r} is not a mean of "
            "a per-pair loss ('sft' is a token mean over the microbatch, 'aot' and 'aot_unpaired' sort the "
            f"microbatch's pairs); supported: {sorted(DPO_PER_PAIR)}"
        )


def dpo_pairs(inputs: Mapping[str, Any]) -> int:
    """The number of preference pairs in a collated DPO microbatch: half its rows (chosen rows, then rejected).

    Raises:
        GradaggError: no ``input_ids`` tensor, or an odd number of rows.
    """
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    rows = getattr(ids, "shape", (None,))[0] if ids is not None else None
    if not isinstance(rows, int) or rows % 2:
        keys = sorted(str(k) for k in inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise GradaggError(
            f"a DPO microbatch must hold 'input_ids' with its chosen rows then its rejected rows (an even number), "
            f"got {rows!r} rows (keys: {keys}); pass weight=fn giving each microbatch's number of pairs"
        )
    return rows // 2


def default_weight(kind: str | None) -> Callable[[Mapping[str, Any]], object] | None:
    """The default count of a TRL trainer kind: pairs for DPO; None for the token count of a causal LM."""
    return dpo_pairs if kind == "dpo" else None


def check_even_microbatches(trainer: Any, loader: Any) -> None:
    """Refuse, on every rank, a TRL trainer whose ranks would run different numbers of microbatches.

    TRL's ``compute_loss`` gathers its metrics across ranks at every microbatch (``gather_for_metrics``): a rank
    with one microbatch more would wait there for ever while the others wait in ``finish()``. The ranks' loader
    lengths are gathered once, here, before the first microbatch (every rank reaches ``on_train_begin``).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    length = len(loader) if loader is not None and hasattr(loader, "__len__") else None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, length)
    uneven = len(set(every)) > 1
    unknown = None in every and not getattr(trainer.accelerator, "even_batches", True)
    if uneven or unknown:
        counts = ", ".join(f"rank {r}: {'unknown' if n is None else n}" for r, n in enumerate(every))
        raise GradaggError(
            f"exact() cannot train this {type(trainer).__name__} on ranks with different numbers of microbatches "
            f"per epoch ({counts}): TRL gathers its metrics across ranks at every microbatch, so a rank with more "
            "would wait for ever; keep Accelerate's even_batches=True (accelerator_config), or give every rank as "
            "many batches"
        )


__all__ = ["check_even_microbatches", "check_trl", "default_weight", "dpo_pairs", "trl_trainer"]
