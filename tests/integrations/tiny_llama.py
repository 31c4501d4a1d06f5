"""The one model, data and truth every integration test uses (no downloads: a model from a config).

A tiny ``LlamaForCausalLM`` (vocab 128, hidden 32, 2 layers) and right-padded sequences of 3 to 48 tokens whose
prompt and padding are labelled -100. The truth is the float64 one-process token mean over exactly the sequences a
step consumed: sum over those sequences of the token-summed loss, divided by their total number of counted tokens
(labels other than -100 after the causal shift). Right padding leaves every real token's loss unchanged (causal
attention sees only earlier, real tokens), so each sequence can be evaluated on its own.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

import torch

VOCAB = 128
PAD = 0


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=PAD, bos_token_id=1, eos_token_id=2)


def model(seed: int = 0, *, loss_kwargs: bool = True) -> torch.nn.Module:
    """The same float32 model on every rank for the same seed.

    ``loss_kwargs=False``: the same model, declared as taking no loss kwargs (``accepts_loss_kwargs = False``), as a
    model whose forward has no ``**kwargs`` would be: the Trainer then passes it no ``num_items_in_batch``.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cls = LlamaForCausalLM if loss_kwargs else _no_loss_kwargs_class()
    return cls(config())  # type: ignore[no-any-return]


def _no_loss_kwargs_class() -> type:
    from transformers import LlamaForCausalLM

    class NoLossKwargsLlamaForCausalLM(LlamaForCausalLM):  # type: ignore[misc]
        accepts_loss_kwargs = False

    return NoLossKwargsLlamaForCausalLM


def tokenizer() -> Any:
    """A word-level tokenizer over the model's vocabulary (tokens ``t0`` ... ``t127``), built here: no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    raw = Tokenizer(WordLevel(vocab, unk_token="t3"))
    raw.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=f"t{PAD}", bos_token="t1", eos_token="t2",
                                   unk_token="t3")


def sequences(seed: int, count: int) -> list[dict[str, list[int]]]:
    """``count`` sequences of 3 to 48 tokens, a prompt of 1 to 3 tokens labelled -100."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(3, 48)
        ids = [rng.randrange(3, VOCAB) for _ in range(n)]
        prompt = rng.randint(1, min(3, n - 1))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def collate(seqs: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest: padding is PAD in ``input_ids``, 0 in ``attention_mask``, -100 in ``labels``."""
    width = max(len(s["input_ids"]) for s in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s["input_ids"])
        ids[i, :n] = torch.tensor(s["input_ids"])
        labels[i, :n] = torch.tensor(s["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens the model's loss counts: labels other than -100 after the causal shift."""
    return int((batch["labels"][:, 1:] != -100).sum())


def token_sum_loss(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The token-summed cross-entropy of ``batch`` (the model's own loss with a divisor of 1)."""
    return m(**batch, num_items_in_batch=torch.tensor(1)).loss  # type: ignore[no-any-return]


def truth(m: torch.nn.Module, seqs: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """float64 gradients of the token mean over ``seqs``, one process, one sequence at a time."""
    m64 = copy.deepcopy(m).double()
    m64.zero_grad(set_to_none=True)
    total = sum(tokens(collate([s])) for s in seqs)
    for s in seqs:
        (token_sum_loss(m64, collate([s])) / total).backward()
    return {n: p.grad.detach().clone() for n, p in m64.named_parameters() if p.grad is not None}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max |got - want| / max |want| over every parameter (names must match)."""
    if set(got) != set(want):
        raise AssertionError(f"parameters differ: {sorted(set(got) ^ set(want))}")
    scale = max(float(w.abs().max()) for w in want.values())
    return max(float((got[n].double() - want[n]).abs().max()) for n in want) / scale
