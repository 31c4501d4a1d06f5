"""Rank workers for FSDP2 beyond float sharding: mixed precision, CPU offload, parameters outside FSDP, refusals.

Every ``*_world`` runs on each rank of a 2-rank gloo world (importable by the ranks) and returns plain
values: gradients as float64 full tensors, error types and messages. The references run in one process:
:func:`reference_world` is the same FSDP2 model with the same policy in a 1-rank world, the whole batch in one
backward (what a one-process bf16 run computes); :func:`truth64` is the float64 model without FSDP.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.errors import GradaggError
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.placements import is_dtensor
from tests.torch.workers import dist as w
from tests.torch.workers import train as tw

Grads = dict[str, torch.Tensor]
# MixedPrecisionPolicy arguments by name; "inputs" is the dtype the step casts its inputs to itself.
POLICIES: dict[str, dict[str, Any]] = {
    "bf16, reduce fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},  # torchtitan's
    "bf16, reduce None": {"param_dtype": torch.bfloat16, "reduce_dtype": None},  # FSDP then reduces in bf16
    "bf16, output fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.float32},
    "bf16, inputs cast by hand": {
        "param_dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "cast_forward_inputs": False,
        "inputs": torch.bfloat16,
    },
    "fp16, reduce fp32": {"param_dtype": torch.float16, "reduce_dtype": torch.float32},
}
# mode, microbatches per rank: "shards" (the default) pads by itself; "every_microbatch" (its former name) by hand
RUNS = [("shards", [0, 4]), ("shards", [1, 5]), ("window", [0, 4]), ("window", [1, 5]), ("every_microbatch", [1, 5])]


class Blocks(nn.Module):
    """Two tanh blocks and a linear head (float32: the dtype FSDP2 keeps the sharded parameters in)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in every reference
        self.blocks = nn.ModuleList(nn.Linear(w.D_IN, w.D_IN) for _ in range(2))
        self.head = nn.Linear(w.D_IN, 1)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def loss_sum(model: nn.Module, batch: tw.TokenBatch, inputs: torch.dtype = torch.float32) -> torch.Tensor:
    """The sum over valid tokens of the squared error, taken in float32 whatever the model computes in."""
    x, y, _, mask = batch
    return ((model(x.to(inputs)).float() - y.float())[mask] ** 2).sum()


def policy(name: str | None) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs = {k: v for k, v in POLICIES[name].items() if k != "inputs"} if name else {}
    return MixedPrecisionPolicy(**kwargs)


def shard(model: Blocks, mesh: Any, mp: Any, layout: str = "root") -> Blocks:
    """fully_shard the blocks and then, by ``layout``: the root (``"root"``); nothing more (``"blocks only"``: the
    head stays plain); the root with the head ignored (``"ignored"``); the root, with the head attached after it
    (``"attached after"``). The last three leave the head's parameters outside every FSDP unit. An
    ``output_dtype`` applies to the outermost units only (inner blocks feed bf16 into bf16)."""
    from torch.distributed.fsdp import fully_shard

    inner = mp if layout == "blocks only" else dataclasses.replace(mp, output_dtype=None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=inner)
    if layout == "root":
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif layout == "ignored":
        fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=set(model.head.parameters()))
    elif layout == "attached after":
        head = model.head
        del model.head
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.head = head
    return model


def full_grads(model: nn.Module) -> Grads:
    """Every gradient as a float64 full tensor (a DTensor's full_tensor: a collective, in the same order everywhere)."""
    out: Grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None:
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().double().cpu()
    return out


def accumulate(model: nn.Module, counts: list[int], mode: str, inputs: torch.dtype = torch.float32) -> dict[str, Any]:
    """Token-weighted microbatches ``counts[rank]`` of tw.token_batches, every_microbatch padding with weight-0
    ones; two windows (the second reuses the hooks and FSDP's unsharded parameters), the same batches in each."""
    rank, data = dist.get_rank(), tw.token_batches(sum(counts))
    mine = [(b, True) for b in tw.share(data, counts, rank)]
    if mode == "every_microbatch":
        mine += [(data[0], False)] * (max(counts) - len(mine))
    acc = MicrobatchAccumulator(model, fsdp=mode)  # type: ignore[arg-type]
    windows = []
    for _ in range(2):
        for batch, real in acc.microbatches(mine):  # look-ahead: buckets (HSDP: the all-reduce) in the last
            with acc.microbatch(weight=int(batch[3].sum()) if real else 0):
                (loss_sum(model, batch, inputs) * (1.0 if real else 0.0)).backward()
        ledger = acc.finish()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        windows.append(full_grads(model))
        model.zero_grad()
    acc.close()
    return {
        "divisor": ledger.divisor,
        "grad_kinds": sorted({f"{type(g).__name__} {str(g.dtype).removeprefix('torch.')} {g.device}" for g in grads}),
        "grads": windows[0],
        "second_window_same": all(torch.equal(windows[0][n], windows[1][n]) for n in windows[0]),
    }


def _mesh(shape: tuple[int, ...] = (2,)) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)


def _safely(fn: Any, *args: Any) -> Any:
    """fn(*args), or ("GradaggError subclass name", message) when gradagg refuses."""
    try:
        return fn(*args)
    except GradaggError as exc:
        return type(exc).__name__, str(exc)


# --- mixed precision ------------------------------------------------------------------------------------------


def mixed_precision_world() -> dict[tuple[str, str, str], Any]:
    """Every policy of POLICIES x RUNS: the accumulated gradients (and D, and what the gradients are)."""
    out: dict[tuple[str, str, str], Any] = {}
    for name, spec in POLICIES.items():
        for mode, counts in RUNS:
            model = shard(Blocks(), _mesh(), policy(name))
            out[(name, mode, str(counts))] = _safely(accumulate, model, counts, mode, spec.get("inputs", torch.float32))
    for mode, counts in RUNS[:4]:  # each block casts its input to bf16 and its output to fp32; the head is plain
        model = shard(Blocks(), _mesh(), policy("bf16, output fp32"), "blocks only")
        out[("bf16, output fp32, blocks only", mode, str(counts))] = _safely(accumulate, model, counts, mode)
    return out


def reference_world(layouts: list[tuple[str, str, int]]) -> dict[tuple[str, str, int], Grads]:
    """1 rank: per (policy, layout, n), FSDP2 with that policy over the first n microbatches in one backward."""
    out = {}
    for name, layout, n in layouts:
        model = shard(Blocks(), _mesh((1,)), policy(name if name in POLICIES else None), layout)
        data = tw.token_batches(n)
        whole = tuple(torch.cat([b[i] for b in data]) for i in range(4))
        inputs = POLICIES.get(name, {}).get("inputs", torch.float32)
        (loss_sum(model, whole, inputs) / whole[3].sum()).backward()  # type: ignore[arg-type]
        out[(name, layout, n)] = full_grads(model)
    return out


def truth64(n: int, start: int = 0) -> Grads:
    """The float64 gradient of the token mean over microbatches ``start`` to ``n - 1``, no FSDP, one backward."""
    model = Blocks(torch.float64)
    x, y, _, mask = (torch.cat([b[i] for b in tw.token_batches(n)[start:]]) for i in range(4))
    ((model(x) - y)[mask] ** 2).mean().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# --- sums in float32: a gradient that bf16 accumulation loses ------------------------------------------------

EXACT_CASES: dict[str, tuple[dict[str, Any], torch.dtype]] = {  # name -> (policy, dtype of the parameters)
    "bf16 compute, reduce fp32": ({"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, torch.float32),
    "bf16 compute, reduce None": ({"param_dtype": torch.bfloat16}, torch.float32),
    "fp16 compute, reduce None": ({"param_dtype": torch.float16}, torch.float32),
    "bf16 parameters": ({}, torch.bfloat16),
    "fp16 parameters": ({}, torch.float16),
}
EXACT_RUNS = [
    ("shards", (2,)),
    ("window", (2,)),
    ("every_microbatch", (2,)),
    ("shards", (2, 1)),
    ("window", (2, 1)),
    ("every_microbatch", (2, 1)),
]
ONES = 16  # microbatches of gradient 1 after the first, of gradient BIG


def big(dtype: torch.dtype) -> float:
    """2**p for a p-bit significand: BIG + 1 rounds back to BIG in that dtype (bf16: 256, fp16: 2048)."""
    return 2.0 / torch.finfo(dtype).eps  # eps = 2**-(p - 1)


def exact_world() -> dict[tuple[str, str, str], Any]:
    """y = W x, loss sum(y), W (4, 2) sharded by rows: each microbatch's gradient is its x in every row.

    Rank 1 runs 1 + ONES microbatches with x = BIG, then 1, 1, ... (weight 1 each); rank 0 runs none (window;
    shards, padding by itself) or as many weight-0 ones (every_microbatch, FSDP reducing each). Every value is exact
    in the compute dtype, and so is the sum BIG + ONES; the mean is (BIG + ONES) / (1 + ONES). Summing in the
    compute dtype would lose every 1 (BIG + 1 rounds to BIG) and give BIG / (1 + ONES). On mesh (2, 1) (HSDP, one
    shard per replica) the every_microbatch form defers the replicas' all-reduce to the last microbatch (look-
    ahead).
    """
    out = {}
    for name, (mp, dtype) in EXACT_CASES.items():
        for mode, shape in EXACT_RUNS:
            out[(name, mode, str(shape))] = _exact(mp, dtype, mode, shape)
    for name in ("bf16 compute, reduce fp32", "bf16 parameters"):  # as if FSDP did not call the sharded hooks
        out[(name, "hooks not run", "(2,)")] = _safely(_exact, *EXACT_CASES[name], "every_microbatch", (2,), True)
    return out


def _exact(mp: dict[str, Any], dtype: torch.dtype, mode: str, shape: tuple[int, ...], unhook: bool = False) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, compute = dist.get_rank(), mp.get("param_dtype", dtype)
    torch.manual_seed(0)
    model = nn.Linear(2, 4, bias=False).to(dtype)
    fully_shard(model, mesh=_mesh(shape), mp_policy=MixedPrecisionPolicy(**mp))
    xs = [big(compute)] + [1.0] * ONES
    mine = [(x, rank == 1) for x in xs] if mode == "every_microbatch" or rank == 1 else []
    acc = MicrobatchAccumulator(model, fsdp=mode)  # type: ignore[arg-type]
    if unhook:  # FSDP then sums the reduced shards into .grad itself, in the parameter's dtype
        for t, handle in acc.state.hooked.values():
            if is_dtensor(t):
                handle.remove()
    for x, real in acc.microbatches(mine):
        with acc.microbatch(weight=1 if real else 0):
            (model(torch.full((1, 2), x, dtype=dtype)).float().sum() * (1.0 if real else 0.0)).backward()
    acc.finish()
    g = model.weight.grad
    acc.close()
    return {
        "grad": g.full_tensor().double(),  # type: ignore[union-attr]
        "dtype": g.dtype,  # type: ignore[union-attr]
        "want": (big(compute) + ONES) / (1 + ONES),
        "lossy": big(compute) / (1 + ONES),
    }


# --- parameters outside FSDP, CPU offload ----------------------------------------------------------------------

MIXED_LAYOUTS = ["blocks only", "ignored", "attached after"]


def outside_fsdp_world() -> dict[tuple[str, str, str], Any]:
    """The head's parameters in no FSDP unit (three ways), plain in float32, on mesh (2,) and HSDP (2, 1);
    CPUOffloadPolicy; then the refusals: a DTensor no fully_shard manages, a plain parameter replaced later."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    out: dict[tuple[str, str, str], Any] = {}
    for layout in MIXED_LAYOUTS:
        for mode, counts in RUNS:
            model = shard(Blocks(), _mesh(), policy(None), layout)
            out[(layout, mode, str(counts))] = _safely(accumulate, model, counts, mode)
    for mode, counts in RUNS:  # HSDP: the head summed over all ranks, the blocks over shard then replicas
        model = shard(Blocks(), _mesh((2, 1)), policy(None), "blocks only")
        out[("blocks only, HSDP", mode, str(counts))] = _safely(accumulate, model, counts, mode)
    for mode, counts in RUNS:
        model = Blocks()
        for block in model.blocks:
            fully_shard(block, mesh=_mesh(), offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=_mesh(), offload_policy=CPUOffloadPolicy(pin_memory=False))
        out[("cpu offload", mode, str(counts))] = _safely(accumulate, model, counts, mode)
    for mode in ("shards", "window", "every_microbatch"):
        out[("unmanaged DTensor", mode, "[0, 2]")] = _safely(_unmanaged_dtensor, mode)
        out[("plain replaced", mode, "[1, 1]")] = _safely(_plain_replaced, mode)
    return out


def _unmanaged_dtensor(mode: str) -> Any:
    """A Shard(0) DTensor registered on the root after fully_shard: no FSDP unit gathers or reduces it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model = shard(Blocks(), _mesh(), policy(None))
    model.gain = nn.Parameter(distribute_tensor(torch.ones(w.D_IN), _mesh(), [Shard(0)]))
    acc = MicrobatchAccumulator(model, fsdp=mode)  # type: ignore[arg-type]
    rank, data = dist.get_rank(), tw.token_batches(2)
    for batch in data if rank == 1 or mode == "every_microbatch" else []:
        with acc.microbatch():
            model(batch[0].float() * model.gain.full_tensor()).sum().backward()
    return acc.finish()


def _plain_replaced(mode: str) -> Any:
    """After the accumulator is built, rank 1 replaces the plain head's weight by a new Parameter (same name)."""
    model = shard(Blocks(), _mesh(), policy(None), "blocks only")
    acc = MicrobatchAccumulator(model, fsdp=mode)  # type: ignore[arg-type]
    if dist.get_rank() == 1:
        model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    batch = tw.token_batches(2)[dist.get_rank()]
    with acc.microbatch():
        loss_sum(model, batch).backward()
    return acc.finish()


# --- refused layouts -------------------------------------------------------------------------------------------


def refused_world() -> dict[str, Any]:
    """Layouts gradagg does not reduce: each must raise GradaggError at construction, naming parameter and placement."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    out: dict[str, Any] = {}
    model = Blocks()
    parallelize_module(model.blocks[0], _mesh(), ColwiseParallel())
    out["tensor parallel"] = _safely(MicrobatchAccumulator, model)

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = Blocks()
    parallelize_module(model.blocks[0], mesh["tp"], ColwiseParallel())
    parallelize_module(model.blocks[1], mesh["tp"], RowwiseParallel())
    shard(model, mesh["dp"], policy(None))
    out["FSDP + TP, 2-D mesh"] = _safely(MicrobatchAccumulator, model)

    mesh3 = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = Blocks()
    parallelize_module(model.blocks[0], mesh3["tp"], ColwiseParallel())
    shard(model, mesh3["replicate", "shard"], policy(None))
    out["HSDP + TP, 3-D mesh"] = _safely(MicrobatchAccumulator, model)

    model = Blocks()
    for block in model.blocks:
        fully_shard(block, mesh=_mesh(), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    fully_shard(model, mesh=_mesh())
    out["Shard(1)"] = _safely(functools.partial(MicrobatchAccumulator, model, fsdp="every_microbatch"))
    return out


def unshard_peak_world(mode: str) -> dict[str, Any]:
    """How many FSDP modules gradagg's own ``unshard()`` calls hold unsharded at once when a window opens, and
    whether the model is sharded again when the first microbatch's forward starts; then the gradient against
    the float64 truth (the same window as :func:`accumulate`'s, counts [1, 1])."""
    from torch.distributed.fsdp import FSDPModule

    model = shard(Blocks(), _mesh(), policy(None))
    held, peak = 0, 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            def unshard(*a: Any, _m: Any = m, **k: Any) -> Any:
                nonlocal held, peak
                held += 1
                peak = max(peak, held)
                return type(_m).unshard(_m, *a, **k)

            def reshard(*a: Any, _m: Any = m, **k: Any) -> Any:
                nonlocal held
                held -= 1
                return type(_m).reshard(_m, *a, **k)

            m.unshard, m.reshard = unshard, reshard  # type: ignore[method-assign]
    acc = MicrobatchAccumulator(model, fsdp=mode)  # type: ignore[arg-type]
    batch = tw.token_batches(2)[dist.get_rank()]
    with acc.microbatch(weight=int(batch[3].sum())):
        sharded_at_forward = all(is_dtensor(p) for p in model.parameters())
        loss_sum(model, batch).backward()
    acc.finish()
    return {"peak": peak, "sharded at forward": sharded_at_forward, "modules": 3}
