"""Counting the tokens a causal language model's loss counts: shared by the framework integrations.

A causal LM predicts position ``i + 1`` from positions ``0..i``, so its loss drops each row's first label
(the "causal shift") and ignores every label equal to ``IGNORE`` (-100: prompt and padding). The count of
a microbatch is therefore ``(labels[..., 1:] != -100).sum()``; a collator that already shifted the labels
(padding-free batches) hands them as ``shift_labels``, which are counted as they are. This is the count
transformers' ``ForCausalLMLoss`` divides by, and TRL's ``SFTTrainer`` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradagg.errors import GradaggError

IGNORE = -100


def label_tokens(batch: Mapping[str, Any], where: str = "the microbatch") -> int:
    """The number of labels a causal LM's loss counts in ``batch``: not -100, after the causal shift.

    Args:
        batch: a collated microbatch holding ``labels`` (``[..., seq]`` integer tensor) or ``shift_labels``.
        where: what to call the batch in an error message.

    Returns:
        The count, a non-negative int.

    Raises:
        GradaggError: ``batch`` holds neither ``labels`` nor ``shift_labels`` as an integer tensor.

    >>> import torch
    >>> label_tokens({"labels": torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, 8]])})
    4
    >>> label_tokens({"shift_labels": torch.tensor([[5, 6, -100]])})
    2
    """
    if "shift_labels" in batch:
        labels, shifted = batch["shift_labels"], True
    elif "labels" in batch:
        labels, shifted = batch["labels"], False
    else:
        keys = sorted(str(k) for k in batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise GradaggError(
            f"{where} has no 'labels' to count tokens from (keys: {keys}); pass weight=fn giving each "
            "microbatch's count"
        )
    if getattr(labels, "is_floating_point", lambda: True)() or getattr(labels, "dim", lambda: 0)() < 1:
        raise GradaggError(
            f"{where}: 'labels' must be an integer tensor of token ids with a sequence dimension, got "
            f"{type(labels).__name__} {getattr(labels, 'dtype', '')}; pass weight=fn for another kind of loss"
        )
    kept = labels if shifted else labels[..., 1:]
    return int((kept != IGNORE).sum())


__all__ = ["IGNORE", "label_tokens"]
