"""grad_norm and clip_grad_norm_ in one process: equal to torch.nn.utils.clip_grad_norm_, each tensor once."""

from __future__ import annotations

import pytest

import torch
from gradagg.errors import CollectiveError, IdError, NonFiniteGradientError
from gradagg.torch import Ownership, clip_grad_norm_, count_collectives, grad_norm


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.zeros(s, requires_grad=True) for s in [(3, 4), (4,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_equals_torch_clip_grad_norm(max_norm: float) -> None:
    """Same norm and same clipped gradients as torch (clipping active at 0.5, inactive at 1e6), no communication."""
    ours, theirs = _params(3), _params(3)
    with count_collectives() as c:
        n_ours = clip_grad_norm_(ours, max_norm)
    n_theirs = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    # Same per-tensor norms, same stacking, same coefficient: bit-identical, not just close.
    assert torch.equal(n_ours, n_theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)
    assert c.total == 0


def test_tied_weights_counted_once() -> None:
    """Grad (3, 4) passed twice: norm 5 (not 5 * sqrt 2); clipping scales it once, to norm 1."""
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.tensor([3.0, 4.0])
    assert float(grad_norm([p, p])) == 5.0
    clip_grad_norm_({"emb": p, "unemb": p}, 1.0)
    assert p.grad.tolist() == pytest.approx([0.6, 0.8], rel=1e-6)


def test_with_ownership_in_one_process() -> None:
    """Every shard owned by rank 0 (the only rank): the plain norm; an owner that is not a rank: error."""
    params = _params(4)
    named = {f"p{i}": p for i, p in enumerate(params)}
    own = Ownership.from_tensors(named, owners=0)
    assert torch.equal(grad_norm(named, ownership=own), grad_norm(params))
    with pytest.raises(CollectiveError, match="owner rank 1"):
        grad_norm(named, ownership=Ownership.from_tensors(named, owners=1))
    with pytest.raises(IdError, match="shard ids"):
        grad_norm(params, ownership=own)
    with pytest.raises(IdError, match="not declared"):
        grad_norm({"other": params[0]}, ownership=own)


def test_nonfinite() -> None:
    """A NaN gradient makes the norm NaN; error_if_nonfinite raises instead of scaling."""
    params = _params(5)
    params[1].grad[0] = float("nan")
    assert torch.isnan(grad_norm(params))
    with pytest.raises(NonFiniteGradientError, match="nan"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_no_gradients() -> None:
    """Parameters without .grad are skipped; none at all gives norm 0."""
    assert float(grad_norm([torch.zeros(2, requires_grad=True)])) == 0.0
