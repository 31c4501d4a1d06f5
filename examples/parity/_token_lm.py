"""A tiny token-level language model and a window of variable-length sequences, for the parity examples.

By default each microbatch holds 2 sequences padded to LENGTH (``microbatches(n)`` splits the same 16
sequences into n microbatches instead, for ``gradagg parity --sweep``); padding targets are IGNORE (-100), so the valid
token counts differ from microbatch to microbatch: 12, 16, 11, 19, 5, 24, 5, 3 (95 in all; 58 in the
first half, 37 in the second). Unequal counts are what make a wrong divisor visible: with equal ones
a mean of means equals the mean. float64, so a right step matches the full batch to ~1e-16.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, DIM, LENGTH, IGNORE = 11, 6, 12, -100
LENGTHS = [(3, 9), (12, 4), (5, 6), (12, 7), (4, 1), (12, 12), (2, 3), (1, 2)]  # valid tokens per sequence


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # deterministic: the same weights on every call, in every process
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, VOCAB)).double()


def microbatches(n: int = len(LENGTHS)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The window's 16 sequences in ``n`` microbatches of consecutive rows (default 8 of 2 sequences each).

    ``gradagg parity --sweep`` asks for several ``n``: the same rows split into more or fewer microbatches
    (unequal in rows when ``n`` does not divide 16), so every split has the same full batch.
    """
    gen = torch.Generator().manual_seed(1)
    inputs, targets = [], []
    for lengths in LENGTHS:
        x = torch.randint(0, VOCAB, (len(lengths), LENGTH), generator=gen)
        y = torch.randint(0, VOCAB, (len(lengths), LENGTH), generator=gen)
        for row, valid in enumerate(lengths):
            y[row, valid:] = IGNORE
        inputs.append(x)
        targets.append(y)
    rows = zip(torch.cat(inputs).tensor_split(n), torch.cat(targets).tensor_split(n))
    return [(x.clone(), y.clone()) for x, y in rows]


def full_batch_loss(model: torch.nn.Module, microbatches: list) -> torch.Tensor:
    """The truth: one forward over the whole window, cross-entropy averaged over all its valid tokens."""
    inputs = torch.cat([x for x, _ in microbatches])
    targets = torch.cat([y for _, y in microbatches])
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE)


def token_loss(model: torch.nn.Module, microbatch: tuple, reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of one microbatch: summed over its valid tokens (default), or their mean."""
    inputs, targets = microbatch
    logits = model(inputs).reshape(-1, VOCAB)
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction=reduction)


def n_tokens(microbatch: tuple) -> int:
    """Valid (not padding) target tokens of one microbatch."""
    return int((microbatch[1] != IGNORE).sum())


def all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum every gradient over the ranks; a rank that ran no microbatch adds zeros (it still must join)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def shard_blocks_and_root(model: torch.nn.Module) -> list:
    """FSDP2: ``fully_shard`` the embedding and the output layer, then the root; returns the FSDP modules.

    Every parameter becomes a DTensor shard (rows of dim 0) on each rank. The FSDP modules are returned
    so that a step can set what FSDP's per-module setters (``set_gradient_divide_factor``) do not recurse to.
    """
    import warnings

    from torch.distributed.fsdp import fully_shard

    # torch 2.13 warns, every forward, that a module returned a view (Linear on 3-d input does): a trap for
    # in-place ops on the output, which token_loss does not do.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return [fully_shard(model[0]), fully_shard(model[2]), fully_shard(model)]
