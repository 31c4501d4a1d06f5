"""The causal-shift token count the integrations weight microbatches by, and the package's light import.

The truths are counted by other routes than ``_tokens.py``'s tensor formula: a plain Python loop over the labels,
and the count transformers' own ``ForCausalLMLoss`` divides by (its mean over its sum). The data reach what a
wrong count would get wrong (issue 36): a first label that counts (pretraining data, no masked prompt), token id
0, rows with nothing to count, 1-D labels and already shifted ones.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from gradagg.errors import GradaggError
from gradagg.integrations._tokens import label_tokens
from tests.integrations import tiny_llama as tl

IGNORE = -100
TOKEN_SEED = 3636  # the batches below are drawn from it
BATCHES = 60
# the classes of data a wrong count gets wrong, each of which the seeded batches must reach
CLASSES = ("first label counts", "token id 0 counted", "row with nothing counted", "1-D labels", "shift_labels")


def python_count(rows: list[list[int]], shifted: bool) -> int:
    """Plain Python: each row's labels from position 1 on (from 0 when already shifted) that are not -100."""
    count = 0
    for row in rows:
        for position, label in enumerate(row):
            if (shifted or position > 0) and label != IGNORE:
                count += 1
    return count


def models_count(labels: torch.Tensor, shifted: bool) -> int:
    """The number of tokens transformers' ``ForCausalLMLoss`` averages over: its summed loss over its mean.

    With all-zero logits every counted token's loss is log(vocab), so the ratio is the count up to rounding.
    """
    logits = torch.zeros(*labels.shape, tl.VOCAB)
    kwargs = {"shift_labels": labels} if shifted else {}
    total = float(ForCausalLMLoss(logits, labels, tl.VOCAB, num_items_in_batch=1, **kwargs))
    if total == 0.0:  # nothing counted: the mean would be 0 / 0
        return 0
    return round(total / float(ForCausalLMLoss(logits, labels, tl.VOCAB, **kwargs)))


def draw(rng: random.Random) -> tuple[list[list[int]], bool, bool]:
    """One batch of label rows (one width), whether it is 1-D, whether it is handed as ``shift_labels``."""
    width, rows, flat = rng.randint(1, 7), rng.randint(1, 4), rng.random() < 0.2
    pool = [IGNORE, IGNORE, 0, 1, 5, tl.VOCAB - 1]
    labels = [[rng.choice(pool) for _ in range(width)] for _ in range(1 if flat else rows)]
    return labels, flat, rng.random() < 0.3


def classes(labels: list[list[int]], flat: bool, shifted: bool) -> set[str]:
    """Which of CLASSES one batch reaches."""
    kept = [row if shifted else row[1:] for row in labels]
    return {name for name, hit in [
        ("first label counts", any(row[0] != IGNORE for row in labels)),
        ("token id 0 counted", any(0 in row for row in kept)),
        ("row with nothing counted", any(all(t == IGNORE for t in row) for row in kept)),
        ("1-D labels", flat),
        ("shift_labels", shifted),
    ] if hit}


def test_label_tokens_counts_what_the_causal_shift_keeps() -> None:
    """The cases a wrong count gets wrong, written out: the first label never counts (it is no prediction), -100
    never counts, token id 0 counts; already shifted labels count from their first."""
    assert label_tokens({"labels": torch.tensor([[5, 6, -100]])}) == 1  # no masked prompt: 6 only
    assert label_tokens({"labels": torch.tensor([[-100, 0, 7]])}) == 2  # token id 0 is a token
    assert label_tokens({"labels": torch.tensor([0, 0, 0])}) == 2  # 1-D, all token 0
    assert label_tokens({"labels": torch.tensor([[9]])}) == 0  # one label: nothing to predict it from
    assert label_tokens({"shift_labels": torch.tensor([[5, 0, -100]])}) == 2


def test_label_tokens_matches_a_python_count_and_the_models_own() -> None:
    """Seeded batches (TOKEN_SEED): label_tokens equals the plain Python count and the count transformers'
    ForCausalLMLoss divides by; every class in CLASSES is reached at least once."""
    rng, reached = random.Random(TOKEN_SEED), Counter[str]()
    for b in range(BATCHES):
        labels, flat, shifted = draw(rng)
        reached.update(classes(labels, flat, shifted))
        tensor = torch.tensor(labels[0] if flat else labels)
        got = label_tokens({"shift_labels" if shifted else "labels": tensor})
        want = python_count(labels, shifted)
        assert got == want == models_count(tensor, shifted), (TOKEN_SEED, b, labels, shifted, got, want)
    assert all(reached[c] > 0 for c in CLASSES), reached


def test_label_tokens_matches_the_integrations_data() -> None:
    """The padded batches every integration test trains on (a -100 prompt first): the same Python count."""
    batch = tl.collate(tl.sequences(5, 6))
    rows = batch["labels"].tolist()
    assert label_tokens(batch) == python_count(rows, False) > 0
    assert label_tokens({"shift_labels": batch["labels"][:, 1:]}) == python_count(rows, False)


def test_label_tokens_refuses_what_it_cannot_count() -> None:
    """No labels (naming the keys, or the type of what is not a mapping), floating or 0-dim labels, labels that are
    not a tensor: a GradaggError naming the batch, never a TypeError."""
    no_labels = r"^the microbatch has no 'labels' to count tokens from \(keys: \['a', 'b'\]\)"
    with pytest.raises(GradaggError, match=no_labels):
        label_tokens({"b": torch.zeros(1, 3, dtype=torch.long), "a": 1})
    with pytest.raises(GradaggError, match=r"^batch 4 has no 'labels' to count tokens from \(keys: list\)"):
        label_tokens(["input_ids"], "batch 4")  # type: ignore[arg-type]
    for labels in (torch.zeros(2, 3), torch.tensor(5), [[5, 6, 7]], None):
        with pytest.raises(GradaggError, match="'labels' must be an integer tensor of token ids with a sequence"):
            label_tokens({"labels": labels})


def test_import_integrations_loads_no_framework() -> None:
    code = "import sys, gradagg, gradagg.integrations; print([m for m in sys.modules if m in {'transformers', 'trl'}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
