"""Rank workers: FSDP2's ``MixedPrecisionPolicy`` and ``torch.autocast`` in one loop, both of the accumulator's forms;
and autocast alone (plain, DDP, FSDP2 with float32 parameters) on any number of ranks, with a clip that acts.

The model, loss and float64 truth of :mod:`tests.torch.workers.amp` (two layers, a loss summed over rows and
weighted by them), each layer and the root ``fully_shard``-ed with one policy: FSDP casts the float32 sharded
parameters to ``param_dtype`` for the forward and backward, reduces in ``reduce_dtype``, and autocast of the same
dtype wraps the forward. Without a policy (``"bf16"``, ``"fp16"``) autocast alone lowers the compute. The
microbatch counts are uneven, a rank with none in some windows, the last window short; per window the unscaled
(and, where asked, clipped) gradient is compared with the float64 token mean of every rank's rows at the same
parameters. With fp16, ``torch.amp.GradScaler``, and one window blown up on rank 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import amp

# MixedPrecisionPolicy arguments by name; autocast runs in the policy's param_dtype
POLICIES: dict[str, dict[str, torch.dtype]] = {
    "bf16, reduce fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},  # torchtitan's
    "bf16, reduce bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16},
    "bf16, output fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.float32},
    "fp16, reduce fp32": {"param_dtype": torch.float16, "reduce_dtype": torch.float32},
}
FSDP_FORMS = ("shards", "window")  # a layout is one of these, "plain" or "ddp"
# microbatches per rank, per window: a rank with none, the last window the shortest
COUNTS = {2: ([3, 0], [1, 2], [2, 1], [0, 1]), 3: ([3, 0, 1], [1, 2, 0], [0, 1, 2], [1, 0, 0])}
OVERFLOW = (2, 1)  # (window, rank) whose loss is blown up past fp16's range under a GradScaler
Case = tuple[str, str, float, bool]  # layout, policy (or "bf16", "fp16": autocast alone), clip (0: none), scaled


def _batches(counts: list[int], window: int) -> list[torch.Tensor]:
    """Every rank's microbatches of a window, in rank order: 1 to 5 rows of 6 features, seeded by the window."""
    g = torch.Generator().manual_seed(100 + window)
    return [torch.randn(int(torch.randint(1, 6, (1,), generator=g)), 6, generator=g) for _ in range(sum(counts))]


def _mine(counts: list[int], window: int, rank: int) -> list[torch.Tensor]:
    start = sum(counts[:rank])
    return _batches(counts, window)[start:start + counts[rank]]


def _grads64(twin: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in twin.named_parameters()}  # type: ignore[union-attr]


def truth(twin: nn.Module, counts: list[int], window: int) -> dict[str, torch.Tensor]:
    """float64, one process, no autocast: the mean over every row of the window at ``twin``'s parameters."""
    model = amp._model().double()
    model.load_state_dict({k: v.double() for k, v in twin.state_dict().items()})
    xs = torch.cat(_batches(counts, window)).double()
    return _grads64(model, model(xs).pow(2).sum() / len(xs))


def naive(twin: nn.Module, counts: list[int], window: int) -> dict[str, torch.Tensor]:
    """The usual recipe's weighting, in float64: each rank's mean over its own rows, averaged over the ranks (a rank
    with none contributes zero and still counts, as FSDP's average over the world does)."""
    model = amp._model().double()
    model.load_state_dict({k: v.double() for k, v in twin.state_dict().items()})
    ranks = [torch.cat(_mine(counts, window, r)).double() for r in range(len(counts)) if counts[r]]
    return _grads64(model, sum(model(x).pow(2).sum() / len(x) for x in ranks) / len(counts))  # type: ignore[arg-type]


def floor(twin: nn.Module, counts: list[int], window: int, dtype: torch.dtype,
          scale: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each of the window's microbatches back-propagated alone in one process under autocast (``dtype``, the loss
    scaled by ``scale`` and the gradient unscaled, as a GradScaler does) and divided by the window's rows: summed
    exactly (float64), what the low-precision forward and backward cost, the same for every way of summing them;
    and summed in ``dtype`` (a running low-precision sum, the known wrong way: 256 + 1 = 256 in bf16)."""
    model = amp._model()
    model.load_state_dict(twin.state_dict())
    xs = _batches(counts, window)
    rows = sum(len(x) for x in xs)
    exact = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    lossy = {n: torch.zeros_like(p, dtype=dtype) for n, p in model.named_parameters()}
    for x in xs:
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = amp._loss(model, x)
        (loss * scale).backward()
        for n, p in model.named_parameters():
            exact[n] += p.grad.double() / scale  # type: ignore[union-attr]
            lossy[n] += (p.grad / scale).to(dtype)  # type: ignore[union-attr]
    return {n: t / rows for n, t in exact.items()}, {n: t.double() / rows for n, t in lossy.items()}


def _built(layout: str, policy: str) -> nn.Module:
    """The model as ``layout`` wraps it: plain, DDP, or FSDP2 with ``policy`` (none for autocast alone)."""
    if layout == "plain":
        return amp._model()
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(amp._model())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = amp._model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    spec = POLICIES.get(policy, {})
    inner = MixedPrecisionPolicy(**{k: v for k, v in spec.items() if k != "output_dtype"})  # type: ignore[arg-type]
    for layer in (model[0], model[2]):  # inner layers feed the compute dtype on; only the root casts its output
        fully_shard(layer, mesh=mesh, mp_policy=inner)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**spec))  # type: ignore[arg-type]
    return model


def mp_autocast_world(cases: list[Case]) -> list[list[dict[str, Any]]]:
    """Each case of :func:`mp_autocast_case` in turn, a model each; a case that raised gives ``[{"raised": its
    message}]`` and ends the world's cases (a peer may now wait in a collective)."""
    out: list[list[dict[str, Any]]] = []
    for case in cases:
        try:
            out.append(mp_autocast_case(*case))
        except Exception as exc:
            return out + [[{"raised": f"{type(exc).__name__}: {exc}"}]] * (len(cases) - len(out))
    return out


def mp_autocast_case(layout: str, policy: str, clip: float = 0.0, scaled: bool = False) -> list[dict[str, Any]]:
    """Per window: the gradient's relative error (norm) and max-abs error in eps S (eps the compute dtype's, S the
    largest |truth|) against the float64 token mean, clipped to ``clip`` as torch clips when ``clip`` > 0; the
    truth's norm; D; what ``.grad`` is; whether the step ran; the scale; the usual weighting's relative error."""
    rank, counts = dist.get_rank(), COUNTS[dist.get_world_size()]
    dtype = POLICIES[policy]["param_dtype"] if policy in POLICIES else amp.DTYPES[policy]
    model = _built(layout, policy)
    form: dict[str, Any] = {"fsdp": layout} if layout in FSDP_FORMS else {}
    acc = MicrobatchAccumulator(model, **form)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaled else None
    out = []
    for window in range(len(counts)):
        twin = _full(model)
        want = truth(twin, counts[window], window)
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        low, lossy = floor(twin, counts[window], window, dtype, scale)
        for x in acc.microbatches(_mine(counts[window], window, rank)):
            with acc.microbatch(weight=len(x)):
                with torch.autocast("cpu", dtype=dtype):
                    loss = amp._loss(model, x)
                if scaled and (window, rank) == OVERFLOW:
                    loss = loss * 1e30  # past fp16's range once the backward runs in fp16: a real overflow
                (scaler.scale(loss) if scaler is not None else loss).backward()
        ledger = acc.finish()
        if scaler is not None:
            scaler.unscale_(opt)
        out.append(_measure(model, want, low, clip, dtype))
        out[-1].update(divisor=ledger.divisor, lossy_added=amp._relative(lossy, low),  # type: ignore[arg-type]
                       naive=amp._relative(naive(twin, counts[window], window), want))  # type: ignore[arg-type]
        amp.step(opt, scaler)
        out[-1]["scale"] = None if scaler is None else float(scaler.get_scale())  # after the scaler's update
        after = _full(model)
        out[-1]["stepped"] = any(not torch.equal(a, b) for a, b in zip(twin.parameters(), after.parameters()))
    acc.close()
    return out


def _measure(model: nn.Module, want: dict[str, torch.Tensor], low: dict[str, torch.Tensor], clip: float,
             dtype: torch.dtype) -> dict[str, Any]:
    """The window's gradient (clipped first when ``clip``) against the truth and the floor, clipped the same way."""
    kinds = sorted({f"{type(p.grad).__name__} {p.grad.dtype}" for p in model.parameters() if p.grad is not None})
    norm = sum(float(t.pow(2).sum()) for t in want.values()) ** 0.5
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # a DTensor norm: reduced over the mesh
        coef = clip / (sum(float(t.pow(2).sum()) for t in low.values()) ** 0.5 + 1e-6)
        low = {n: t * min(1.0, coef) for n, t in low.items()}
        want = {n: t * min(1.0, clip / (norm + 1e-6)) for n, t in want.items()}  # torch's coefficient
    got = _grads(model)
    finite = all(g is None or bool(g.isfinite().all()) for g in got.values())
    scale = torch.finfo(dtype).eps * max(float(t.abs().max()) for t in want.values())
    return {
        "error": amp._relative(got, want) if finite else float("nan"),
        "eps_s": max(float((g - want[n]).abs().max()) for n, g in got.items() if g is not None) / scale,
        "floor": amp._relative(low, want),  # type: ignore[arg-type]
        "added": amp._relative(got, low) if finite else float("nan"),
        "finite": finite, "norm": norm, "grad_kinds": kinds,
    }


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _full(model: nn.Module) -> nn.Module:
    """A plain float32 twin holding ``model``'s full parameters (for FSDP2 a collective: every rank calls it)."""
    twin = amp._model()
    twin.load_state_dict({n: getattr(p, "full_tensor", p.detach)().detach().clone()
                          for n, p in _inner(model).named_parameters()})
    return twin


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every gradient as a float64 full tensor, ``None`` where absent (for FSDP2 a collective)."""
    return {n: None if p.grad is None else getattr(p.grad, "full_tensor", p.grad.detach)().double()
            for n, p in _inner(model).named_parameters()}


def warned_world() -> dict[str, list[str]]:
    """Per (form, policy): the PrecisionWarnings ``MicrobatchAccumulator`` gave at construction, with the file and
    line they name (the caller's, here)."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gradagg.errors import PrecisionWarning

    out: dict[str, list[str]] = {}
    for form in FSDP_FORMS:
        for name, policy in POLICIES.items():
            model = amp._model()
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))
            fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                acc = MicrobatchAccumulator(model, fsdp=form)  # type: ignore[arg-type]
            out[f"{form}: {name}"] = [f"{w.filename.rsplit('/', 1)[-1]}: {w.message}" for w in caught
                                      if issubclass(w.category, PrecisionWarning)]
            acc.close()
    return out
