"""Rank workers: FSDP1 (``FullyShardedDataParallel``) under the accumulator (importable by the ranks).

The model is float64 (FSDP1 keeps the parameters' dtype), so that the one-process full batch is a float64 truth;
its gradient is read back through an SGD step of rate 1 (``before - after``, exact in float64) and
``FSDP.summon_full_params``, which works for ``use_orig_params`` True and False alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import train as tw

Grads = dict[str, torch.Tensor]
PREFIX = "_fsdp_wrapped_module."
# (sharding strategy, use_orig_params, wrapping): wrapping "root" is one unit, "nested" one unit per Linear too
CONFIGS = [
    ("FULL_SHARD", True, "root"),
    ("FULL_SHARD", False, "root"),
    ("FULL_SHARD", True, "nested"),
    ("FULL_SHARD", False, "nested"),
    ("SHARD_GRAD_OP", True, "nested"),
    ("SHARD_GRAD_OP", False, "root"),
]
# on 4 ranks, 2 replicas x 2 shards: FSDP1 runs no communication hook there, gradagg rescales its average
HYBRID_CONFIGS = [("HYBRID_SHARD", True, "nested"), ("_HYBRID_SHARD_ZERO2", False, "root")]
# counts per rank of each window (its microbatches are the next global ones), and whether microbatches() looks ahead
WINDOWS = [([3, 5], True), ([0, 4], False), ([2, 0], True), ([1, 1], False)]
WINDOWS_4 = [([3, 0, 5, 1], True), ([0, 0, 2, 0], False), ([1, 1, 1, 1], True)]  # 4 ranks


def _model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the truth
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(dtype)


def loss_sum(model: nn.Module, batch: tw.TokenBatch, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Sum over the valid tokens of the squared error (the unscaled loss a weighted microbatch backpropagates)."""
    x, y, _, mask = batch
    return ((model(x.to(dtype)).double() - y)[mask] ** 2).sum()


def truth(batches: list[tw.TokenBatch]) -> Grads:
    """The one-process full batch in float64: the gradient of the mean over every valid token."""
    model = _model()
    x, y, mask = (torch.cat([b[i] for b in batches]) for i in (0, 1, 3))
    ((model(x) - y)[mask] ** 2).mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def wrap(strategy: str, orig: bool, wrapping: str, **kw: Any) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({nn.Linear}) if wrapping == "nested" else None
    model = kw.pop("model", None)
    if "HYBRID" in strategy and "device_mesh" not in kw:  # replicas x shards of 2
        from torch.distributed.device_mesh import init_device_mesh

        kw["device_mesh"] = init_device_mesh("cpu", (dist.get_world_size() // 2, 2))
    return FSDP(_model() if model is None else model, sharding_strategy=ShardingStrategy[strategy],
                use_orig_params=orig, device_id=torch.device("cpu"), auto_wrap_policy=policy, **kw)


def full_params(model: nn.Module) -> Grads:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return {n.replace(PREFIX, ""): p.detach().clone() for n, p in model.named_parameters()}


def stepped_grads(model: nn.Module) -> Grads:
    """The full gradient the optimizer sees: an SGD step of rate 1 on the shards, read back whole."""
    before = full_params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.step()
    after = full_params(model)
    with torch.no_grad():  # undo the step: the next window starts from the same weights as the truth's model
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad)
    model.zero_grad()
    return {n: before[n] - after[n] for n in before}


def error(got: Grads, want: Grads) -> float:
    """The largest error relative to the largest entry, parameter by parameter (NaN counts as infinite)."""
    return max(float((got[n] - want[n]).nan_to_num(nan=float("inf")).abs().max() / want[n].abs().max()) for n in want)


def exact_world(configs: list[tuple[str, bool, str]] = CONFIGS) -> dict[str, Any]:
    """Every configuration x every window (:data:`WINDOWS`, :data:`WINDOWS_4` on 4 ranks): the relative error of the
    stepped gradient against the truth, the ledger's divisor and padding."""
    rank, out = dist.get_rank(), {}
    data = tw.token_batches(40)
    windows = WINDOWS_4 if dist.get_world_size() == 4 else WINDOWS
    for config in configs:
        model = wrap(*config)
        acc = MicrobatchAccumulator(model)
        start = 0
        for counts, look in windows:
            window = data[start : start + sum(counts)]
            start += sum(counts)
            mine = tw.share(window, counts, rank)
            for batch in acc.microbatches(mine) if look else mine:
                with acc.microbatch(weight=int(batch[3].sum())):
                    loss_sum(model, batch).backward()
            ledger = acc.finish()
            out[(*config, str(counts))] = {
                "error": error(stepped_grads(model), truth(window)),
                "divisor": ledger.divisor,
                "padded": acc.state.padded_last,
            }
        acc.close()
        out[(*config, "after close")] = _after_close(model, data[: dist.get_world_size()], rank)
    return out


def _after_close(model: nn.Module, batches: list[tw.TokenBatch], rank: int) -> float:
    """Once the accumulator is closed, FSDP1's own average is back: one microbatch per rank, per-rank sum losses,
    give the mean over the ranks of the sums (error against it)."""
    loss_sum(model, batches[rank]).backward()
    got = stepped_grads(model)
    sums = [truth([b]) for b in batches]
    tokens = [int(b[3].sum()) for b in batches]
    want = {n: sum(s[n] * t for s, t in zip(sums, tokens)) / len(batches) for n in sums[0]}  # type: ignore[misc]
    return error(got, want)


# by world size: the sharding strategy, the window's counts per rank, the global microbatches drawn (FSDP1's own
# recipe runs the last 3 per rank, the same count on every rank, as it needs)
MIXED = {2: ("FULL_SHARD", [3, 5], 10), 4: ("HYBRID_SHARD", [3, 0, 5, 1], 12)}  # 4 ranks: 2 replicas x 2 shards


def mixed_precision_world() -> dict[str, Any]:
    """FSDP1's MixedPrecision (bf16 compute, float32 parameters; reduce in float32, or in bf16): gradagg against
    FSDP1's own recipe (a mean loss per microbatch, FSDP1 averaging every reduce), both against float64;
    the strategy and counts of :data:`MIXED` for this world size."""
    from torch.distributed.fsdp import MixedPrecision

    rank, world, out = dist.get_rank(), dist.get_world_size(), {}
    strategy, counts, n = MIXED[world]
    data = tw.token_batches(n)
    mine = tw.share(data, counts, rank)
    want = truth(data[: sum(counts)])
    for reduce in (torch.float32, torch.bfloat16):
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        model = wrap(strategy, True, "nested", model=_model(torch.float32), mixed_precision=policy)
        acc = MicrobatchAccumulator(model)
        for batch in acc.microbatches(mine):
            with acc.microbatch(weight=int(batch[3].sum())):
                loss_sum(model, batch, torch.float32).backward()
        acc.finish()
        got = {n: g.double() for n, g in stepped_grads(model).items()}
        out[str(reduce)] = error(got, want)
        acc.close()
    own = wrap(strategy, True, "nested", model=_model(torch.float32),
               mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    last = data[-3 * world :]
    for x, y, _, mask in tw.share(last, [3] * world, rank):  # its recipe: a mean loss per microbatch over M,
        (((own(x.float()).double() - y)[mask] ** 2).mean() / 3).backward()  # FSDP1 averaging over the ranks
    out["fsdp1 own"] = error({k: g.double() for k, g in stepped_grads(own).items()}, truth(last))
    return out


def terms_world() -> dict[str, Any]:
    """Two loss terms divided ahead (``acc.divisors()``) under FSDP1, against the float64 full batch; and what FSDP1
    does with a second backward through one forward (why ``terms=`` is refused)."""
    rank, out = dist.get_rank(), {}
    data = tw.token_batches(16)
    for config in [("FULL_SHARD", True, "nested"), ("SHARD_GRAD_OP", False, "root")]:
        model = wrap(*config)
        acc = MicrobatchAccumulator(model)
        start = 0
        for counts, look in [([3, 5], True), ([0, 4], False)]:
            window = data[start : start + sum(counts)]
            start += sum(counts)
            mine = tw.share(window, counts, rank)
            div = acc.divisors({"tokens": sum(int(b[3].sum()) for b in mine), "microbatches": len(mine)})
            for batch in acc.microbatches(mine) if look else mine:
                with acc.microbatch():
                    token, aux = _two_terms(model, batch)
                    (token / div["tokens"] + aux / div["microbatches"]).backward()
            acc.finish()
            want = {"tokens": float(sum(int(b[3].sum()) for b in window)), "microbatches": float(len(window))}
            out[(*config, str(counts))] = {"error": error(stepped_grads(model), _terms_truth(window)),
                                           "divisors": div, "want": want}
        acc.close()
    return {"windows": out, "second backward": _second_backward(data[rank])}


def _two_terms(model: nn.Module, batch: tw.TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """From one forward (a padding rank replays one): the squared error summed over the valid tokens, and a term
    normalised per microbatch, the mean square output over every sample, valid or not."""
    x, y, _, mask = batch
    out = model(x)
    return ((out - y)[mask] ** 2).sum(), out.pow(2).mean()


def _terms_truth(batches: list[tw.TokenBatch]) -> Grads:
    """One process, float64: the token mean of the first of :func:`_two_terms`, the microbatch mean of the second."""
    model = _model()
    tokens = sum(int(b[3].sum()) for b in batches)
    terms = [_two_terms(model, b) for b in batches]
    (sum(t for t, _ in terms) / tokens + sum(a for _, a in terms) / len(batches)).backward()  # type: ignore[union-attr]
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _second_backward(batch: tw.TokenBatch) -> str:
    """FSDP1 alone (no accumulator): two backwards through one forward, as two loss terms would need."""
    model = wrap("FULL_SHARD", True, "root")
    out = model(batch[0])
    out.sum().backward(retain_graph=True)
    try:
        out.pow(2).sum().backward()
    except RuntimeError as exc:  # what FSDP1 raises: the second backward reads the freed unsharded parameters
        return str(exc)
    return "ran"


def refusal_world(how: str) -> str:
    """What ``MicrobatchAccumulator`` says of an FSDP1 model built ``how``: the error's type and text."""

    kwargs: dict[str, Any] = {}
    if how == "window":
        kwargs["fsdp"] = "window"
    elif how == "terms":
        kwargs["terms"] = ["a", "b"]
    if how == "no shard":
        model = wrap("NO_SHARD", True, "root")
    elif how == "plain head":  # an FSDP1 unit inside a plain module: its head is in no unit
        model = _model()
        model[0] = wrap("FULL_SHARD", True, "root", model=model[0])
    elif how == "hybrid beside full":  # a FULL_SHARD unit inside a HYBRID_SHARD one
        inner = _model()
        inner[0] = wrap("FULL_SHARD", True, "root", model=inner[0])
        model = wrap("HYBRID_SHARD", True, "root", model=inner)
    elif how == "bf16":
        model = wrap("FULL_SHARD", True, "root", model=_model(torch.bfloat16))
    elif how == "own hook":
        model = wrap("FULL_SHARD", True, "root")
        model.register_comm_hook(None, lambda _s, grad, out: dist.reduce_scatter_tensor(out, grad))
    else:
        model = wrap("FULL_SHARD", True, "root")
    try:
        MicrobatchAccumulator(list(model.named_parameters()) if how == "named" else model, **kwargs)
    except Exception as exc:  # the refusal under test
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


__all__ = [
    "CONFIGS",
    "HYBRID_CONFIGS",
    "MIXED",
    "WINDOWS",
    "WINDOWS_4",
    "exact_world",
    "mixed_precision_world",
    "refusal_world",
    "terms_world",
]


def clip_world() -> dict[str, Any]:
    """FSDP1's own clip (``model.clip_grad_norm_``) inside a window: refused without ``attach``; with it, the window
    finishes first and the norm is the exact gradient's (against the float64 truth's)."""
    from gradagg.errors import WindowError

    rank, out = dist.get_rank(), {}
    data = tw.token_batches(8)
    mine = tw.share(data, [3, 5], rank)
    model = wrap("FULL_SHARD", True, "nested", model=_model(torch.float32))  # FSDP1's clip takes no float64
    acc = MicrobatchAccumulator(model)
    for attached in (False, True):
        if attached:
            acc.attach(torch.optim.SGD(model.parameters(), lr=1.0))
        for batch in acc.microbatches(mine):
            with acc.microbatch(weight=int(batch[3].sum())):
                loss_sum(model, batch, torch.float32).backward()
        try:
            out[attached] = float(model.clip_grad_norm_(1e9))  # type: ignore[operator]
        except WindowError as exc:
            out[attached] = f"WindowError: {exc}"
            acc.discard()
    want = truth(data)
    out["want"] = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in want.values()])))
    return out
