"""The reusable flat buffer, and the accumulator on its public fallback (torch without ``_storage_Use_Count``)."""

from __future__ import annotations

import pytest
import torch

from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.buffers import ReusableBuffer
from tests.torch.workers import dist as w


def test_reused_only_once_every_view_is_gone() -> None:
    """With the private use count: a live view blocks reuse; once it is dropped, the same buffer comes back."""
    pool = ReusableBuffer()
    a = pool.get(4, torch.float32, torch.device("cpu"), zero=True)
    view = a[:2]
    b = pool.get(4, torch.float32, torch.device("cpu"), zero=True)
    assert b is not a
    del view, a
    assert pool.get(4, torch.float32, torch.device("cpu"), zero=True) is b


def test_public_fallback_never_reuses_and_stays_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``torch._C._storage_Use_Count`` (the private API): every window gets a fresh buffer, so a gradient
    kept from one window is never overwritten by the next, and every window's mean is right."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count", raising=False)
    pool = ReusableBuffer()
    a = pool.get(4, torch.float32, torch.device("cpu"), zero=True)
    assert pool.get(4, torch.float32, torch.device("cpu"), zero=True) is not a
    model = w.TinyMoE()
    acc = MicrobatchAccumulator(model)
    first = w.microbatches(2)
    w.accumulate(model, first, acc=acc)
    kept = model.shared.weight.grad
    kept_copy = kept.clone()
    model.zero_grad()
    second = w.microbatches(3, seed=9)
    w.accumulate(model, second, acc=acc)
    assert torch.equal(kept, kept_copy)
    assert w.max_error(w.grads_of(model), w.full_batch_grads(second)) <= 1e-12
