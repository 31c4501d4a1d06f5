"""Rank workers for the MoE norm checks: experts sharded on an "ep" mesh, dense parameters on "dp", plain router.

The model (float64, so that one process and W ranks agree to round-off): tokens are embedded by a tied
``embed``/``unembed`` matrix (plain, replicated), a plain router gates E experts whose stacked weights
``experts.w_in`` (E, D, H) and ``experts.w_out`` (E, H, D) are DTensors ``Shard(0)`` on the "ep" mesh
(E need not divide: a rank may hold no expert), and a ``head`` vector is a DTensor ``Replicate()`` on the
"dp" mesh. Each rank runs its own experts on its data-parallel share of the tokens; the experts' partial
outputs are summed across "ep" by DTensor (``Partial`` -> ``Replicate``), and the gradients flowing back
into the experts' inputs are summed across "ep" too (:func:`enter_experts`), so every gradient is complete
for the share; the step then sums the shares over "dp". The one-process model runs all tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from gradagg.torch import Ownership, clip_grad_norm_, count_collectives, grad_norm

D, H, T = 3, 4, 8  # model width, expert width, tokens in the global batch


class MoE(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Linear(D, D, bias=False, dtype=torch.float64)
        self.unembed = self.embed  # tied: one parameter under two names
        self.router = nn.Linear(D, experts, dtype=torch.float64)
        self.experts = nn.Module()
        self.experts.w_in = nn.Parameter(torch.randn(experts, D, H, generator=g, dtype=torch.float64))
        self.experts.w_out = nn.Parameter(torch.randn(experts, H, D, generator=g, dtype=torch.float64))
        self.head = nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))
        with torch.no_grad():
            for p in (self.embed.weight, self.router.weight, self.router.bias):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        gate = torch.softmax(self.router(x), dim=-1)
        w_in, w_out = self.experts.w_in, self.experts.w_out
        first, mesh = 0, None
        if isinstance(w_in, DTensor):
            mesh = w_in.device_mesh
            first = expert_range(mesh, w_in.shape[0])[0]
            w_in, w_out = w_in.to_local(), w_out.to_local()
            x, gate = enter_experts(x, mesh), enter_experts(gate, mesh)
        hidden = torch.relu(torch.einsum("td,edh->eth", x, w_in))
        y = torch.einsum(
            "te,etd->td", gate[:, first : first + w_in.shape[0]], torch.einsum("eth,ehd->etd", hidden, w_out)
        )
        if mesh is not None:  # sum the experts' parts over "ep" (differentiable)
            y = DTensor.from_local(y, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
        head = self.head.to_local() if isinstance(self.head, DTensor) else self.head
        return (y @ self.unembed.weight * head).sum(-1)


def enter_experts(t: torch.Tensor, ep: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over "ep" (each rank's experts see only their part of it)."""
    return DTensor.from_local(t, ep, [Replicate()]).to_local(grad_placements=[Partial()])


def expert_range(mesh: DeviceMesh, experts: int) -> tuple[int, int]:
    """[first, last) experts of this rank: torch.chunk's split, as Shard(0) places them (trailing ones may be empty)."""
    sizes = [len(c) for c in torch.arange(experts).chunk(mesh.size())]
    sizes += [0] * (mesh.size() - len(sizes))
    first = sum(sizes[: mesh.get_local_rank()])
    return first, first + sizes[mesh.get_local_rank()]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(T, D, generator=g, dtype=torch.float64), torch.randn(T, generator=g, dtype=torch.float64)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error summed over these tokens / T (the global count): shares' gradients add up to the full one."""
    return ((model(x) - y) ** 2).sum() / T


def one_process(experts: int, max_norm: float | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """The truth: the full batch in one process; torch's norm (and, with max_norm, torch's clipped grads)."""
    model = MoE(experts)
    loss_of(model, *batch()).backward()
    params = list(model.parameters())
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf if max_norm is None else max_norm)
    return float(norm), {n: p.grad.clone() for n, p in model.named_parameters()}


def sharded(experts: int, mesh: DeviceMesh) -> nn.Module:
    """The same model with experts Shard(0) on mesh["ep"] and head Replicate() on mesh["dp"]."""
    model = MoE(experts)
    ep, dp = mesh["ep"], mesh["dp"]
    model.experts.w_in = nn.Parameter(distribute_tensor(model.experts.w_in.detach(), ep, [Shard(0)]))
    model.experts.w_out = nn.Parameter(distribute_tensor(model.experts.w_out.detach(), ep, [Shard(0)]))
    model.head = nn.Parameter(distribute_tensor(model.head.detach(), dp, [Replicate()]))
    return model


def train_step(model: nn.Module, mesh: DeviceMesh) -> None:
    """Backward on this rank's data-parallel share, then the reductions the layout needs (see the module doc)."""
    x, y = batch()
    dp = mesh["dp"]
    share = slice(dp.get_local_rank() * T // dp.size(), (dp.get_local_rank() + 1) * T // dp.size())
    loss_of(model, x[share], y[share]).backward()
    for p in model.parameters():  # every gradient is complete for this share: sum the shares over "dp"
        dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=dp.get_group())


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]


def wrong_norms(model: nn.Module) -> dict[str, float]:
    """The known wrong answers, each as a library computes it (see the test for the sources)."""
    local = torch.stack([torch.linalg.vector_norm(g) for g in local_grads(model)]).square().sum()
    world = dist.get_world_size()
    average = local.sqrt().reshape(1).clone()
    dist.all_reduce(average)  # average of per-rank norms over the data-parallel world (DeepSpeed #8469)
    every = local.reshape(1).clone()
    dist.all_reduce(every)  # every rank's copy of the replicated parameters counted (and each expert copy)
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts.")]
    return {
        "average_of_rank_norms": float(average) / world,
        "replicas_counted_on_every_rank": math.sqrt(float(every)),
        "experts_missing": float(grad_norm(dense)),  # DeepSpeed #8613: experts left out of the clip norm
    }


def moe_norm(experts: int, mesh_shape: tuple[int, int]) -> dict[str, Any]:
    """gradagg's norms of one sharded step, the wrong answers, and a clip, against the one-process truth."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "ep"))
    model = sharded(experts, mesh)
    train_step(model, mesh)
    truth, truth_grads = one_process(experts)
    with count_collectives() as built:
        own = Ownership.from_module(model)
    out: dict[str, Any] = {"truth": truth, "from_module": dict(built.by_op)}
    out["grad_error"] = max(float((g - truth_grads[n]).abs().max()) for n, g in full_grads(model).items())
    with count_collectives() as c:
        out["declared"] = float(grad_norm(model.named_parameters(), ownership=own)).hex()
    out["declared_collectives"] = dict(c.by_op)
    with count_collectives() as c:
        out["placements"] = float(grad_norm(model.parameters())).hex()
    out["placements_collectives"] = dict(c.by_op)
    out["wrong"] = wrong_norms(model)
    out["owners"] = {s: (own.spec(s).shape, own.owner(s)) for s in own}
    out["clip"] = clipped(model, own, experts, truth / 2)
    return out


def clipped(model: nn.Module, own: Ownership, experts: int, max_norm: float) -> dict[str, Any]:
    """Clip to half the norm: the scaled gradients against torch's clip of the one-process model."""
    norm = clip_grad_norm_(model.named_parameters(), max_norm, ownership=own)
    _, truth = one_process(experts, max_norm)
    got = full_grads(model)
    return {
        "norm": float(norm).hex(),
        "error": max(float((g - truth[n]).abs().max()) for n, g in got.items()),
        "local": {
            n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).tolist()
            for n, p in model.named_parameters()
        },
    }


def deepspeed_case() -> dict[str, float]:
    """DeepSpeed #8469's numbers: 4 expert gradients 2, 4, 6, 8 Shard(0) over 2 ranks (20 and 100 per rank)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    w = nn.Parameter(distribute_tensor(torch.zeros(4, 1, dtype=torch.float64), mesh, [Shard(0)]))
    w.grad = distribute_tensor(torch.tensor([[2.0], [4.0], [6.0], [8.0]], dtype=torch.float64), mesh, [Shard(0)])
    mine = torch.linalg.vector_norm(w.grad.to_local()).reshape(1)
    dist.all_reduce(mine)
    return {"gradagg": float(grad_norm([w])), "average_of_rank_norms": float(mine) / 2}


def refusals(experts: int) -> dict[str, Any]:
    """A Partial gradient on rank 1 only; a placement differing on rank 1; a Partial parameter everywhere."""
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "ep"))
    model = sharded(experts, mesh)
    train_step(model, mesh)
    own = Ownership.from_module(model)
    w_in = model.experts.w_in
    out: dict[str, Any] = {}
    if dist.get_rank() == 1:  # a gradient left unreduced: partial sums, not a piece
        w_in.grad = DTensor.from_local(torch.zeros(w_in.shape, dtype=torch.float64), w_in.device_mesh, [Partial()])
    out["partial_grad"] = error_of(lambda: grad_norm(model.named_parameters(), ownership=own))
    out["partial_grad_undeclared"] = error_of(lambda: grad_norm(model.parameters()))
    other = sharded(experts, mesh)
    if dist.get_rank() == 1:  # rank 1 replicates what the others shard (from_local: no communication)
        full = torch.zeros(w_in.shape, dtype=torch.float64)
        other.experts.w_in = nn.Parameter(DTensor.from_local(full, w_in.device_mesh, [Replicate()]))
    out["placement_differs"] = error_of(lambda: Ownership.from_module(other))
    partial = nn.Module()
    partial.w = nn.Parameter(DTensor.from_local(torch.zeros(2), w_in.device_mesh, [Partial()]))
    out["partial_param"] = error_of(lambda: Ownership.from_module(partial))
    return out


def error_of(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the tests assert the type and message
        return type(exc).__name__, str(exc)
    return None


def two_rank_world() -> dict[str, Any]:
    """2 ranks: mesh (dp=1, ep=2), 5 experts split 3 + 2; DeepSpeed's case; the refusals."""
    return {"moe": moe_norm(5, (1, 2)), "deepspeed": deepspeed_case(), "refusals": refusals(5)}


def four_rank_world() -> dict[str, Any]:
    """4 ranks: mesh (dp=2, ep=2) with 5 experts; mesh (dp=1, ep=4) with 3 experts (rank 3 holds none)."""
    return {"dp2_ep2": moe_norm(5, (2, 2)), "ep4_uneven": moe_norm(3, (1, 4))}
