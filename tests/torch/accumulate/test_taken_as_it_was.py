"""A gradient the accumulator took counts with its value at that moment, whatever later happens to the tensor it
came from (a ``.grad`` set by hand and reused as a buffer by the caller): the hooks copy or add it into the
window's buffer, they never keep the caller's tensor. Guards the copy of each first gradient, which a faster
design (keep the first gradient, add the second to it) would otherwise drop (bench/RESULTS.md section 3)."""

from __future__ import annotations

import torch

from gradagg.torch import MicrobatchAccumulator


def test_a_grad_set_by_hand_then_changed_counts_as_it_was() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    acc = MicrobatchAccumulator([p])
    mine = torch.ones(3)
    with acc.microbatch():
        p.grad = mine  # taken when the microbatch ends; the caller keeps the tensor
    mine.fill_(100.0)  # reused for something else
    with acc.microbatch():
        (p * 2.0).sum().backward()
    acc.finish()
    assert torch.equal(p.grad, torch.full((3,), 1.5)), p.grad  # (1 + 2) / 2


def test_a_grad_set_before_backward_then_changed_counts_as_it_was() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    acc = MicrobatchAccumulator([p])
    buf = torch.zeros(3)
    with acc.microbatch():
        p.grad = buf  # autograd accumulates into the caller's tensor in place
        (p * 1.0).sum().backward()
    buf.fill_(100.0)
    with acc.microbatch():
        (p * 2.0).sum().backward()
    acc.finish()
    assert torch.equal(p.grad, torch.full((3,), 1.5)), p.grad
