"""The accumulator's group read from a DeviceMesh, on 4 gloo ranks (issue 23, item 4): one world, every check.

The model is :class:`~tests.torch.workers.modes_cp.Context` (a token sees its whole sequence through a sum over
the cp group), its sequences split by hand over the cp ranks. Cases, each against the float64 one-process run:

* ``("dp", "cp") = (2, 2)``: token-mean as you go and seq-mean-token-mean planned (``plan_window`` over
  ``data_group(mesh)``), microbatches 1 and 3 per dp replica, global rank 1 (dp 0, cp 1) with no valid token;
  beside it verl#5983's count (the tokens of this rank's dp group only, the gradients over dp x cp);
* ``("dp", "cp", "tp") = (1, 2, 2)``: the weight ``w`` split by hand (plain tensors) over the tp ranks, its
  partial outputs summed over tp; counted over dp x cp, one group per tp coordinate (a flattened group);
  beside it the count over the whole world, doubled by the tp peers;
* FSDP2 on a 1-D ``("dp_shard_cp",)`` mesh of the 4 ranks, the accumulator on ``("dp_shard", "cp") = (2, 2)``;
* one pipeline stage's ``("dp", "cp")`` mesh, over half the world;
* the refusals: an ambiguous dim name, an unnamed mesh, a group that disagrees with the mesh, an FSDP2 mesh over
  other ranks than the accumulator's group (same size: accepted before).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.errors import GradaggError
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.accumulate.meshes import data_group
from gradagg.torch.modes import Mode, plan_window
from tests.torch.workers import modes as wm
from tests.torch.workers.modes_cp import Context, SumOverGroup, _grads, _microbatches, run_window, truth

TP_COLS = ((0, 2), (2, wm.D))  # tp rank -> its columns of w: uneven, as a hand split may be


class SumForward(torch.autograd.Function):
    """all_reduce(sum) forward, identity backward: a row-parallel layer's output (Megatron's reduce from the
    tensor-parallel region). Every tp rank back-propagates the same loss, so each partial's gradient is the
    upstream one, not its sum over tp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TpContext(nn.Module):
    """:class:`Context` with ``w`` split by columns over the tp ranks: ``w_part`` holds this rank's, ``u`` whole."""

    def __init__(self, tp: int, tp_group: Any, cp_group: Any) -> None:
        super().__init__()
        full = Context()
        a, b = TP_COLS[tp]
        self.cols, self.tp_group, self.cp_group = (a, b), tp_group, cp_group
        self.w_part = nn.Parameter(full.w.weight.detach()[:, a:b].clone())
        self.u = full.u

    def forward(self, x: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor, cp: Any = None) -> torch.Tensor:
        a, b = self.cols
        w_out = SumForward.apply((x[:, a:b] @ self.w_part.T).squeeze(-1), self.tp_group)
        partial = torch.zeros(len(lengths), dtype=x.dtype).index_add(0, index, self.u(x).squeeze(-1))
        partial = SumOverGroup.apply(partial, self.cp_group)  # the other cp rank holds the rest of each sequence
        return w_out + torch.tanh(partial / lengths)[index]


def mesh_world(seed: int) -> dict[str, Any]:
    """Every case above; per case what the test asserts (errors, divisors, dims, refusal messages)."""
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {"refusals": _refusals()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    out["dp x cp"] = _dp_cp(mesh, seed)
    out["tp"] = _tp(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "cp", "tp")), seed)
    out["fsdp"] = _fsdp(seed)
    out["stage"] = _stage()
    return out


def _stage() -> dict[str, Any]:
    """One pipeline stage's mesh, ``("dp", "cp")`` of 2 ranks sliced from ``("pp", "dp", "cp") = (2, 1, 2)``: a
    mesh over part of the world, its flattened group built by its own ranks only, given as ``group=`` (a mesh there
    is ``mesh=``). Rank r weighs r + 1."""
    from torch.distributed.device_mesh import init_device_mesh

    stage = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "cp"))["dp", "cp"]
    lin = wm.model()
    acc = MicrobatchAccumulator(lin, group=stage)
    with acc.microbatch(weight=dist.get_rank() + 1):
        lin(torch.ones(1, wm.D, dtype=torch.float64)).sum().backward()
    ledger = acc.finish()
    acc.close()
    return {"divisor": ledger.divisor, "ranks": ledger.span.ranks, "counted_over": ledger.counted_over}


def _window(seed: int) -> list[wm.Sequence]:
    """:func:`wm.make_window`, the tokens of dp replica 0's cp rank 1 all masked (global rank 1 counts none)."""
    seqs = wm.make_window(seed)
    for k in range(0, len(seqs), 4):  # microbatch 0 of 4 (dp 0's only one) takes sequences 0, 4, 8
        s = seqs[k]
        mask = s.mask.clone()
        mask[len(mask) // 2 or len(mask) :] = False  # cp rank 1 holds the second half
        seqs[k] = dataclasses.replace(s, mask=mask)
    return seqs


def _run(model: nn.Module, acc: MicrobatchAccumulator, mine: list[dict[str, Any]], mode: Mode, plan: Any) -> Any:
    return run_window(model, acc, mine, mode, plan, getattr(model, "cp_group", None))


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _dp_cp(mesh: Any, seed: int) -> dict[str, Any]:
    dp, cp = mesh.get_coordinate()
    seqs = _window(seed)
    mine = _microbatches(seqs, [1, 3], dp, cp)
    res: dict[str, Any] = {"valid": int(sum(int(mb["layout"].mask.sum()) for mb in mine))}
    for mode, planned in ((Mode.TOKEN_MEAN, False), (Mode.SEQ_MEAN_TOKEN_MEAN, True)):
        model = Context()
        model.cp_group = mesh.get_group("cp")  # type: ignore[assignment]
        acc = MicrobatchAccumulator(model, mesh=mesh)
        plan = plan_window(mode, [mb["layout"] for mb in mine], group=data_group(mesh)) if planned else None
        ledger = _run(model, acc, mine, mode, plan)
        if plan is not None:
            plan.check(ledger)
        got, want = _grads(model), truth(mode, seqs)
        case = {"err": _err(got, want), "divisor": ledger.divisor, "counted_over": ledger.counted_over,
                "ranks": ledger.span.ranks, "report": ledger.report()}
        if mode == Mode.TOKEN_MEAN:  # verl#5983: the tokens of this cp rank's dp group only, gradients over dp x cp
            dp_only = sum(w for r, w in enumerate(ledger.weight_per_rank or ()) if r % 2 == cp)
            case["dp_only_factor"] = ledger.divisor / dp_only
            case["dp_only_err"] = _err(got * ledger.divisor / dp_only, want)
        res[mode.value] = case
        acc.close()
    return res


def _tp(mesh: Any, seed: int) -> dict[str, Any]:
    _, cp, tp = mesh.get_coordinate()
    seqs = wm.make_window(seed)
    mine = _microbatches(seqs, [3], 0, cp)
    model = TpContext(tp, mesh.get_group("tp"), mesh.get_group("cp"))
    acc = MicrobatchAccumulator(model, mesh=mesh)
    ledger = _run(model, acc, mine, Mode.TOKEN_MEAN, None)
    want = truth(Mode.TOKEN_MEAN, seqs)  # w's D entries, then u's
    a, b = TP_COLS[tp]
    got = torch.cat([model.w_part.grad.reshape(-1), model.u.weight.grad.reshape(-1)])  # type: ignore[union-attr]
    world_count = torch.tensor(float(ledger.weight_local or 0), dtype=torch.float64)
    dist.all_reduce(world_count)  # what counting over the whole world (tp peers included) would divide by
    acc.close()
    return {"err": _err(got, torch.cat([want[a:b], want[wm.D :]])), "divisor": ledger.divisor,
            "tokens": sum(int(s.mask.sum()) for s in seqs), "world_count": float(world_count),
            "counted_over": ledger.counted_over, "ranks": ledger.span.ranks}


def _fsdp(seed: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard_cp",))  # torchtitan flattens with _flatten
    dp, cp = mesh.get_coordinate()
    seqs = wm.make_window(seed)
    mine = _microbatches(seqs, [1, 3], dp, cp)
    model = Context()
    model.cp_group = mesh.get_group("cp")  # type: ignore[assignment]
    fully_shard(model, mesh=flat)
    acc = MicrobatchAccumulator(model, mesh=mesh)
    ledger = _run(model, acc, mine, Mode.TOKEN_MEAN, None)
    got = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    acc.close()
    return {"err": _err(got, truth(Mode.TOKEN_MEAN, seqs)), "counted_over": ledger.counted_over,
            "reduced_over": ledger.reduced_over, "report": ledger.report()}


def _refused(fn: Any) -> str:
    try:
        fn()
    except GradaggError as exc:
        return str(exc)
    return "accepted"


def _refusals() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    lin = wm.model
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    unnamed = init_device_mesh("cpu", (4,))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    out = {
        "sp": _refused(lambda: MicrobatchAccumulator(lin(), mesh=named)),
        "unnamed": _refused(lambda: MicrobatchAccumulator(lin(), mesh=unnamed)),
        "group": _refused(lambda: MicrobatchAccumulator(lin(), mesh=mesh, group=mesh.get_group("cp"))),
    }
    sharded = lin()
    fully_shard(sharded, mesh=mesh["dp"])  # FSDP over the dp ranks, the accumulator over the cp ranks: both 2
    out["fsdp"] = _refused(lambda: MicrobatchAccumulator(sharded, group=mesh.get_group("cp")))
    return out
