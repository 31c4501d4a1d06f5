"""grad_norm and clip_grad_norm_ in one process: equal to torch.nn.utils.clip_grad_norm_, each tensor once."""

from __future__ import annotations

import pytest
import torch

from gradagg.errors import CollectiveError, GradientShapeError, IdError, NonFiniteGradientError
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


def test_float16_norm_does_not_overflow() -> None:
    """float16 grads of 60000 (each below float16's max 65504): norm sqrt(4) * 60000 = 120000, computed in float32
    (a float16 per-tensor norm overflows to inf, and the clip would then zero every gradient)."""
    p = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    p.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    norm = grad_norm([p])
    assert norm.dtype == torch.float32 and float(norm) == 120000.0


@pytest.mark.parametrize(
    ("dtypes", "want"),
    [
        ((torch.float16, torch.bfloat16), torch.float32),
        ((torch.float32,), torch.float32),
        ((torch.float32, torch.float64), torch.float64),
        ((torch.complex128,), torch.float64),
    ],
)
def test_result_dtype_rule(dtypes: tuple[torch.dtype, ...], want: torch.dtype) -> None:
    """The result is float64 when some gradient is float64 or complex128, else float32; the value is the norm of
    grads (3, 4) in each tensor: sqrt(25 * len(dtypes))."""
    params = []
    for dtype in dtypes:
        p = torch.zeros(2, dtype=dtype, requires_grad=True)
        p.grad = torch.tensor([3.0, 4.0]).to(dtype)
        params.append(p)
    norm = grad_norm(params)
    assert norm.dtype == want
    assert float(norm) == pytest.approx(5.0 * len(dtypes) ** 0.5, rel=1e-7)  # float32 sqrt


def test_clip_scales_mixed_dtypes_and_the_public_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients of three dtypes are scaled by the same coefficient; without the private torch._foreach_mul_ the
    public per-tensor mul_ gives the very same bits."""

    def clipped() -> list[torch.Tensor]:
        params = _params(6)
        for dtype, values in ((torch.float64, [1.0, -2.0, 0.5]), (torch.float16, [0.75, 3.0])):
            params.append(torch.zeros(len(values), dtype=dtype, requires_grad=True))
            params[-1].grad = torch.tensor(values, dtype=dtype)
        clip_grad_norm_(params, 0.25)
        return [p.grad for p in params]

    with_foreach = clipped()
    monkeypatch.delattr(torch, "_foreach_mul_")
    without = clipped()
    for a, b in zip(with_foreach, without):
        assert a.dtype == b.dtype and torch.equal(a, b)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in without]))
    assert float(total) == pytest.approx(0.25, rel=1e-3)  # float16 rounding of one of the gradients


def test_shape_against_the_declaration() -> None:
    """With an ownership, a gradient whose shape differs from its declaration is an error naming both shapes."""
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    own = Ownership.from_tensors({"w": torch.zeros(2)}, owners=0)
    with pytest.raises(GradientShapeError, match=r"'w' has local shape \(3,\); declared \(shape=\(2,\)"):
        grad_norm({"w": p}, ownership=own)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")
def test_gradients_on_two_devices() -> None:
    """Gradients on the CPU and on CUDA: the norm of both, and clipping scales each on its own device."""
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, device="cuda", requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 12.0], device="cuda")
    assert float(clip_grad_norm_([a, b], 6.5)) == pytest.approx(13.0, rel=1e-6)  # float32
    assert a.grad.tolist() == pytest.approx([1.5, 2.0], rel=1e-6) and b.grad.cpu().tolist() == pytest.approx([0, 6])


def test_declared_copies_are_scaled_not_counted() -> None:
    """A tied weight held as two tensors (two pipeline stages): the copy is not counted, but is clipped."""
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    assert float(grad_norm([a, b])) == pytest.approx(50 ** 0.5)  # undeclared: counted twice
    assert float(clip_grad_norm_([a, b], 1.0, copies=[b])) == 5.0
    assert a.grad.tolist() == b.grad.tolist() == pytest.approx([0.6, 0.8], rel=1e-6)
