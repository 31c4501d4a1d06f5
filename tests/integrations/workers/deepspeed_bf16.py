"""DeepSpeed ZeRO in bf16 on every rank of a 2- or 3-rank gloo world: gradagg's loop and DeepSpeed's own recipe.

The same tiny token model as :mod:`deepspeed_zero`, its parameters bf16 under DeepSpeed (``"bf16": {"enabled":
true}``, fp32 master weights in ZeRO's optimizer, torch's SGD with lr 1: the applied gradient is the master
weights' change), the loss summed in float32 over bf16 logits. Each window's applied gradient is recorded beside
the float64 one-process truth of the same forward (the bf16 parameters, read as float64) and beside ``scale``: per
element, the sum over all tokens of the absolute value of each token's float64 gradient, divided by D. A rounding
to bf16 of any sum of token terms moves it by at most 2**-8 of that scale (see the test's tolerance).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.integrations.workers import deepspeed_zero as dz

BF16_U = 2.0**-8  # bf16's unit round-off: 8 significant bits, round to nearest
FLOAT32_U = 2.0**-24
UNEVEN3 = [[[6, 2, 5], [3], []], [[], [4, 6], [2]], [[1], [6], [3]]]  # 3 ranks: one with none, a short window
# window 1: rank 0's second microbatch is non-finite; on 3 ranks, the third runs none in it
OVERFLOW = {2: [[[5, 3], [4]], [[2, 6], [1, 3]], [[4], [6]]],
            3: [[[5, 3], [4], [2]], [[2, 6], [1, 3], []], [[4], [6], [1]]]}
# microbatches per rank in the window of equal counts, where DeepSpeed's weighting is the token mean: each rank's all
# the same sequence, so their gradients point one way and a bf16 running sum rounds at every addition (the worst
# case for it, that of a gradient common to every microbatch)
MANY = 32


def bf16_world(cases: list[tuple[str, int, float]], accelerate: tuple[int, ...] = (),
               trainer: dict[int, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Run each ``(loop, stage, clip)``: "exact" (gradagg on uneven counts, ZeRO-3 padded), "even" and "native"
    (gradagg, and DeepSpeed's own recipe with gradient_accumulation_steps 3, on even counts), "many" and
    "many_native" (one window of MANY full microbatches per rank), "overflow" (gradagg, a non-finite microbatch on
    rank 0 in window 1). Returns per case, per window: the applied gradient's errors (see :func:`errors`), the
    ledger's divisor and whether DeepSpeed applied the step; on 2 ranks, :func:`refusals` too; then, per ZeRO stage
    of ``accelerate``, :func:`accelerate_bf16`; per ZeRO stage of ``trainer``, its Hugging Face Trainer cases
    (:func:`deepspeed_hf.stage_world`, ``bf16`` set in each)."""
    from tests.integrations.workers import deepspeed_hf

    dz.launcher()
    out: dict[str, Any] = {f"{loop}/{stage}/{clip}": _case(loop, stage, clip) for loop, stage, clip in cases}
    if dist.get_world_size() == 2:
        out["refused"] = refusals()
    out.update({f"accelerate/{stage}": accelerate_bf16(stage) for stage in accelerate})
    return {**out, **{f"trainer/{stage}": deepspeed_hf.stage_world(stage, [{**c, "bf16": True} for c in trainer_cases])
                      for stage, trainer_cases in (trainer or {}).items()}}


def engine(stage: int, clip: float, steps: int = 1, **bf16: Any) -> Any:
    """A bf16 ZeRO engine around :class:`deepspeed_zero.Tiny` (seeded), SGD lr 1."""
    import deepspeed

    torch.manual_seed(0)
    model = dz.Tiny()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": steps, "gradient_clipping": clip,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
           "bf16": {"enabled": True, **bf16}}
    optimizer = torch.optim.SGD(model.parameters(), lr=dz.LR)
    ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, dist_init_required=False)
    return ds


def loss_sum(model: Any, tokens: torch.Tensor, labels: torch.Tensor, extra: bool) -> torch.Tensor:
    """The summed token loss, in float32 over the model's (bf16) logits, as Hugging Face models compute it."""
    logits = model(tokens, extra).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                             reduction="sum")


def truth(params: dict[str, torch.Tensor], plan: list[list[int]], window: int, clip: float, extra: bool,
          same: bool = False) -> dict[str, torch.Tensor]:
    """:func:`truth_of` the window's microbatches (rank by rank); ``same``: every microbatch of a rank is its first."""
    batches = [(*dz.microbatch(window, rank, 0 if same else k, valid), extra and dz.uses_extra(window, rank, k))
               for rank, counts in enumerate(plan) for k, valid in enumerate(counts)]
    return truth_of(params, batches, clip)


def truth_of(params: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor, bool]],
             clip: float) -> dict[str, torch.Tensor]:
    """A window of ``batches`` (tokens, labels, whether ``extra`` runs) at the bf16 parameters, in one process:
    ``grad``, its float64 gradient (all tokens' summed losses / all tokens); ``ref``, each microbatch's bf16
    gradient (the same bf16 forward and backward as on its rank) summed exactly, in float64, / all tokens; both
    clipped as DeepSpeed clips, each by its own norm; ``scale``, per element, the sum of |each microbatch's bf16
    gradient| / all tokens."""
    wide, narrow = dz.Tiny().double(), dz.Tiny().to(torch.bfloat16)
    state = {n: p.to(torch.bfloat16) for n, p in params.items()}
    wide.load_state_dict({n: p.double() for n, p in state.items()})
    narrow.load_state_dict(state)
    total = sum(int((labels != -100).sum()) for _, labels, _ in batches)
    for tokens, labels, extra in batches:
        loss_sum(wide, tokens, labels, extra).backward()  # type: ignore[no-untyped-call]
        narrow.zero_grad()
        loss_sum(narrow, tokens, labels, extra).backward()  # type: ignore[no-untyped-call]
        g = _flat(narrow)
        state["ref"] = state.get("ref", torch.zeros_like(g)) + g
        state["scale"] = state.get("scale", torch.zeros_like(g)) + g.abs()
    return {"grad": _clipped(_flat(wide) / total, clip), "ref": _clipped(state["ref"] / total, clip),
            "scale": state["scale"] / total}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, float64, flat (zeros where it has none: ZeRO's flat partitions hold zeros)."""
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).double().flatten()
                      for p in model.parameters()])


def _clipped(grad: torch.Tensor, clip: float) -> torch.Tensor:
    norm = float(grad.norm())
    if clip > 0 and clip / (norm + 1e-6) < 1:  # DeepSpeed's clip_grad_norm_: coefficient max_norm / (norm + 1e-6)
        return grad * (clip / (norm + 1e-6))
    return grad


def errors(applied: torch.Tensor, window: dict[str, torch.Tensor], after: torch.Tensor) -> dict[str, float]:
    """``relative``: ``applied``'s normwise error against the float64 gradient, relative to its norm; ``floor``:
    the same of ``ref`` (what the bf16 forward and backward cost, before any accumulation); ``units``: the largest
    |applied - ref| per element, less the float32 rounding of the master weight the step wrote (``after``: the
    applied gradient is read back from it), in units of BF16_U x the element's scale (where the scale is 0, the
    element must be exactly 0: infinite otherwise)."""
    grad, ref, scale = window["grad"], window["ref"], window["scale"]
    norm = float(grad.norm())
    diff = ((applied - ref).abs() - FLOAT32_U * after.abs() / dz.LR).clamp(min=0)
    zero = scale == 0
    units = float((diff[~zero] / (BF16_U * scale[~zero])).max())
    if bool((diff[zero] > 0).any()):
        units = float("inf")
    return {"relative": float((applied - grad).norm()) / norm, "floor": float((ref - grad).norm()) / norm,
            "added": float((applied - ref).norm()) / norm, "units": units}


def _plan(loop: str) -> list[list[list[int]]]:
    if loop == "overflow":
        return OVERFLOW[dist.get_world_size()]
    if loop in ("many", "many_native"):
        return [[[dz.LENGTH] * MANY for _ in range(dist.get_world_size())]]
    if loop in ("even", "native"):
        return dz.EVEN
    return UNEVEN3 if dist.get_world_size() == 3 else dz.UNEVEN


def _case(loop: str, stage: int, clip: float) -> dict[str, Any]:
    from gradagg.integrations.deepspeed import exact

    rank, plan, same = dist.get_rank(), _plan(loop), loop.startswith("many")
    native = loop.endswith("native")
    extra = loop == "exact" and stage != 3
    steps = len(plan[0][0]) if loop == "many_native" else 3 if native else 1
    ds = engine(stage, clip, steps)
    acc = None if native else exact(ds)
    out: dict[str, Any] = {"errors": [], "divisors": [], "applied": [], "reports": [], "norms": []}
    for window, per_rank in enumerate(plan):
        before = dz.full(ds)
        expected = truth(before, per_rank, window, clip, extra, same)
        out["norms"].append(float(truth(before, per_rank, window, 0.0, extra, same)["grad"].norm()))
        if acc is None:
            dz.native_window(ds, per_rank[rank], window, rank, same)
        else:
            _exact_window(ds, acc, per_rank, window, rank, extra, loop == "overflow" and window == 1, same)
            ledger = acc.ledger
            out["divisors"].append(ledger.divisor)
            out["applied"].append(ledger.step_applied)
            out["reports"].append(ledger.report())
        after = dz.full(ds)
        applied = torch.cat([(before[n] - after[n]).flatten() for n in before]) / dz.LR
        written = torch.cat([after[n].flatten() for n in before])
        out["errors"].append({"unchanged": bool((applied == 0).all()), **errors(applied, expected, written)})
    out["global_steps"], out["skipped_steps"] = ds.global_steps, ds.skipped_steps
    return out


def _exact_window(ds: Any, acc: Any, per_rank: list[list[int]], window: int, rank: int, extra: bool,
                  poison: bool, same: bool) -> None:
    """gradagg's loop (ZeRO-3: a rank that ran out pads with weight-0 microbatches); ``poison``: rank 0's second
    microbatch back-propagates its loss times infinity (non-finite gradients on that rank only)."""
    mine = per_rank[rank]
    rounds = max(len(c) for c in per_rank) if ds.zero_optimization_stage() == 3 else len(mine)
    for k in range(rounds):
        padding = k >= len(mine)
        tokens, labels = dz.microbatch(window, rank, 0 if same else k, 1 if padding else mine[k])
        with acc.microbatch(weight=0 if padding else mine[k]):
            loss = loss_sum(ds, tokens, labels, extra and dz.uses_extra(window, rank, k))
            if poison and rank == 0 and k == 1:
                loss = loss * float("inf")
            ds.backward(0 * loss if padding else loss)
    ds.step()


def refusals() -> dict[str, Any]:
    """exact() on the bf16 engines it refuses: ZeRO-1 with data_types.grad_accum_dtype fp32 (DeepSpeed's
    BF16_Optimizer), bf16.check_grad_overflow false. Each: the error's type and message."""
    import deepspeed

    from gradagg.integrations.deepspeed import exact

    out: dict[str, Any] = {}
    for name, stage, extra in (("grad_accum_fp32", 1, {"data_types": {"grad_accum_dtype": "fp32"}}),
                               ("no_overflow_check", 2, {"bf16": {"enabled": True, "check_grad_overflow": False}})):
        model = dz.Tiny()
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
               "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "bf16": {"enabled": True}, **extra}
        ds, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=dz.LR),
                                      config=cfg, dist_init_required=False)
        try:
            exact(ds)
            out[name] = None
        except Exception as e:  # the test checks the type and the message
            out[name] = (type(e).__name__, str(e))
    return out


def accelerate_bf16(stage: int) -> dict[str, Any]:
    """Accelerate's DeepSpeed plugin with ``mixed_precision="bf16"``, ZeRO ``stage``: the accumulator from
    ``gradagg.integrations.accelerate.exact`` on the prepared engine, windows of 3 sequences (Accelerate steps the
    engine inside the backward of each window's last, so that microbatch's bf16 gradient is still on the
    parameters when the window finishes) and the short last one of 2. Per window the errors of :func:`errors`;
    the engine's dtype and step count. Accelerate's state reset first (its private ``_reset_state``, as
    :func:`deepspeed_accel.accelerate_world`; test-only)."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState

    from gradagg.integrations import accelerate as integration
    from tests.integrations.workers.deepspeed_accel import SEQUENCES, STEPS, VALID

    dz.launcher()
    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": STEPS, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
        "bf16": {"enabled": True}})
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=STEPS, mixed_precision="bf16")
    torch.manual_seed(0)
    model = dz.Tiny()
    loader: Any = torch.utils.data.DataLoader(list(range(SEQUENCES)), batch_size=1)  # type: ignore[arg-type]
    ds, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=dz.LR), loader)
    acc = integration.exact(accelerator, ds, optimizer)
    out: dict[str, Any] = {"errors": [], "dtype": str(next(ds.module.parameters()).dtype)}
    seen, before = [], dz.full(ds)
    for (i,) in loader:
        seen.append(int(i))
        tokens, labels = dz.microbatch(0, 0, int(i), VALID[int(i)])
        with accelerator.accumulate(ds), acc.microbatch(weight=VALID[int(i)]):
            accelerator.backward(loss_sum(ds, tokens, labels, False))
        if accelerator.sync_gradients:
            every: list[list[int]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(every, seen)
            batches = [(*dz.microbatch(0, 0, j, VALID[j]), False) for ids in every for j in ids]
            after = dz.full(ds)
            applied = torch.cat([(before[n] - after[n]).flatten() for n in before]) / dz.LR
            written = torch.cat([after[n].flatten() for n in before])
            out["errors"].append(errors(applied, truth_of(before, batches, 0.0), written))
            seen, before = [], after
    acc.close()
    out["global_steps"] = ds.global_steps
    return out
