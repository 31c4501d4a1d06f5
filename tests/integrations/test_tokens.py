"""The causal-shift token count the integrations weight microbatches by, and the package's light import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gradagg.errors import GradaggError
from gradagg.integrations._tokens import label_tokens
from tests.integrations import tiny_llama as tl


def test_label_tokens_matches_the_models_own_count() -> None:
    """Row-wise: labels other than -100 from position 1 on; the same count tiny_llama's truth divides by."""
    batch = tl.collate(tl.sequences(5, 6))
    assert label_tokens(batch) == tl.tokens(batch)
    assert label_tokens({"shift_labels": batch["labels"][:, 1:]}) == tl.tokens(batch)


def test_label_tokens_refuses_what_it_cannot_count() -> None:
    with pytest.raises(GradaggError, match="no 'labels'"):
        label_tokens({"input_ids": torch.zeros(1, 3, dtype=torch.long)})
    with pytest.raises(GradaggError, match="integer tensor"):
        label_tokens({"labels": torch.zeros(2, 3)})


def test_import_integrations_loads_no_framework() -> None:
    code = "import sys, gradagg, gradagg.integrations; print([m for m in sys.modules if m in {'transformers', 'trl'}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
