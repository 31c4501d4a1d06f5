"""DeepSpeed ZeRO on every rank of a 2-rank gloo world: gradagg's loop and DeepSpeed's own recipe, window by window.

Each case builds a fresh engine (CPU accelerator, float32, torch's SGD with lr 1) around the same tiny token model,
runs three windows of right-padded sequences with token counts that differ per microbatch, and records, per
window, the gradient the optimizer applied ((parameters before - after) / lr) next to the float64 one-process
truth: every window's summed token losses divided by its total token count, clipped as DeepSpeed clips.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
import torch.distributed as dist

VOCAB, LENGTH, LR = 11, 6, 1.0
# window -> rank -> valid tokens of each of its microbatches (a sequence of LENGTH, right-padded)
UNEVEN = [[[6, 2, 5], [3]], [[], [4, 6]], [[1], [6]]]  # 3+1, 0+2, then a short window of 1+1
EVEN = [[[6, 2, 5], [3, 1, 4]], [[2, 6, 3], [5, 5, 1]], [[1, 6], [6, 2]]]  # windows of 3, 3 and the short one of 2


def random_plan(seed: int, windows: int = 4) -> list[list[list[int]]]:
    """A seeded plan: 0-3 microbatches per rank per window, 0-6 valid tokens each, at least one token per window."""
    rng = random.Random(seed)
    plan = [[[rng.randint(0, LENGTH) for _ in range(rng.randint(0, 3))] for _ in range(2)] for _ in range(windows)]
    for window in plan:
        if not any(v for counts in window for v in counts):
            window[0].append(LENGTH)
    return plan


class Tiny(torch.nn.Module):
    """Embedding, one hidden layer, a head; ``extra`` counts only in microbatches that ask for it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.emb(tokens)))
        logits: torch.Tensor = self.head(h + self.extra(h) if extra else h)
        return logits


def microbatch(window: int, rank: int, k: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels (-100 past ``valid``) of one sequence, the same on every process that asks."""
    g = torch.Generator().manual_seed(1000 * window + 100 * rank + k)
    tokens = torch.randint(0, VOCAB, (1, LENGTH), generator=g)
    labels = torch.randint(0, VOCAB, (1, LENGTH), generator=g)
    labels[:, valid:] = -100
    return tokens, labels


def loss_sum(model: Any, tokens: torch.Tensor, labels: torch.Tensor, extra: bool) -> torch.Tensor:
    logits = model(tokens, extra)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                             reduction="sum")


def uses_extra(window: int, rank: int, k: int) -> bool:
    """Only rank 0's first microbatch uses ``extra``: absent on rank 1 and in later windows (zero-filled).
    Not under ZeRO-3 or DeepSpeed's own loop, whose ranks must run the same modules (their collectives)."""
    return window == 0 and rank == 0 and k == 0


def deepspeed_world(cases: list[tuple[str, int, float, int]]) -> dict[str, Any]:
    """Run each ``(loop, stage, clip, seed)``: loop "exact" (gradagg, uneven counts; ZeRO-3 padded), "native"
    (DeepSpeed's recipe, even counts, gradient_accumulation_steps 3), "fuzz" (gradagg on ``random_plan(seed)``).
    Returns per case the per-window relative errors, DeepSpeed's step count and the true norms; plus the
    refusals."""
    launcher()
    out: dict[str, Any] = {}
    for loop, stage, clip, seed in cases:
        out[f"{loop}/{stage}/{clip}"] = _case(loop, stage, clip, seed)
    out.update(_refusals())
    return out


def launcher() -> None:
    """The variables a launcher sets, which DeepSpeed reads, for a world the harness already initialised; and no
    compiled shared-memory op (:func:`no_shared_memory_op`)."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29999")
    no_shared_memory_op()


def no_shared_memory_op() -> None:
    """Mark DeepSpeed's shared-memory op ``deepspeed_shm_comm`` as not buildable here, before its first
    ``init_distributed``, so that DeepSpeed does not JIT-compile it.

    Why: with a C++ compiler and ninja present (ninja comes with DeepSpeed), DeepSpeed's CPU accelerator compiles
    that op at its first ``init_distributed``: minutes on 2 cores, on every machine and every venv whose torch
    lives elsewhere (torch's extension cache keys on the include paths). The op serves only
    ``inference_all_reduce`` (tensor-parallel inference); ZeRO's reductions go through ``torch.distributed`` (gloo)
    with or without it, so nothing gradagg does changes. There is no setting for it: ``deepspeed.ops.
    __compatible_ops__`` (DeepSpeed 0.19.8's private probe of which ops can be built, read by
    ``deepspeed.comm.torch.build_shm_op``) marked False is the path DeepSpeed takes where the op cannot build
    (off Linux). Fallback: without that name DeepSpeed compiles as before (slower, the same results), and
    ``test_deepspeed_compiled_nothing`` fails, naming this function.
    """
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def shared_memory_op_built() -> bool:
    """Whether DeepSpeed's communication backend of this process holds the compiled shared-memory op."""
    from deepspeed import comm

    return getattr(comm.comm.cdb, "shm_comm_op", None) is not None


def _engine(stage: int, clip: float, steps: int = 1) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = Tiny()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": steps, "gradient_clipping": clip,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, dist_init_required=False)
    return engine


def full(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter, whole and float64 (a collective under ZeRO-3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().double().clone() for n, p in engine.module.named_parameters()}


def _truth(params: dict[str, torch.Tensor], plan: list[list[int]], window: int, clip: float,
           extra: bool) -> torch.Tensor:
    """The float64 one-process gradient of the window: all ranks' token sums / all tokens, clipped as DeepSpeed."""
    model = Tiny().double()
    model.load_state_dict(params)
    total = sum(v for counts in plan for v in counts)
    for rank, counts in enumerate(plan):
        for k, valid in enumerate(counts):
            tokens, labels = microbatch(window, rank, k, valid)
            loss_sum(model, tokens, labels, extra and uses_extra(window, rank, k)).backward()  # type: ignore[no-untyped-call]
    # a parameter absent from every microbatch: DeepSpeed's flat ZeRO partitions hold zeros for it
    g = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in model.parameters()]) / total
    norm = float(g.norm())
    if clip > 0 and clip / (norm + 1e-6) < 1:  # DeepSpeed's clip_grad_norm_: coefficient max_norm / (norm + 1e-6)
        g = g * (clip / (norm + 1e-6))
    return g


def _case(loop: str, stage: int, clip: float, seed: int) -> dict[str, Any]:
    from gradagg.integrations.deepspeed import exact

    rank = dist.get_rank()
    plan = EVEN if loop == "native" else random_plan(seed) if loop == "fuzz" else UNEVEN
    extra = loop != "native" and stage != 3
    engine = _engine(stage, clip, steps=3 if loop == "native" else 1)
    acc = None if loop == "native" else exact(engine)
    errors, norms, ledgers, counted = [], [], [], []
    for window, per_rank in enumerate(plan):
        before = full(engine)
        truth = _truth(before, per_rank, window, 0.0, extra)
        norms.append(float(truth.norm()))
        truth = _truth(before, per_rank, window, clip, extra)
        if acc is not None:
            _exact_window(engine, acc, per_rank, window, rank, extra, pad=stage == 3)
            ledgers.append(acc.ledger.divisor if acc.ledger else None)
            if acc.ledger is not None:
                counted.append({"m": acc.ledger.microbatches_global, "weighting": acc.ledger.weighting,
                                "participation": dict(acc.ledger.participation_global or {})})
        else:
            native_window(engine, per_rank[rank], window, rank)
        after = full(engine)
        applied = torch.cat([(before[n] - after[n]).flatten() for n in before]) / LR
        errors.append(float((applied - truth).norm() / truth.norm()))
    return {"errors": errors, "global_steps": engine.global_steps, "true_norms": norms, "divisors": ledgers,
            "counted": counted}


def _exact_window(engine: Any, acc: Any, per_rank: list[list[int]], window: int, rank: int, extra: bool,
                  pad: bool = False) -> None:
    """gradagg's loop; ``pad`` (ZeRO-3): a rank that ran out runs weight-0 microbatches of zero loss, so that
    every rank runs as many forwards (ZeRO-3 gathers parameters collectively in each)."""
    mine = per_rank[rank]
    rounds = max(len(c) for c in per_rank) if pad else len(mine)
    for k in range(rounds):
        padding = k >= len(mine)
        tokens, labels = microbatch(window, rank, k, 1 if padding else mine[k])
        with acc.microbatch(weight=torch.tensor(0 if padding else mine[k])):
            loss = loss_sum(engine, tokens, labels, extra and uses_extra(window, rank, k))
            engine.backward(0 * loss if padding else loss)
    engine.step()


def native_window(engine: Any, mine: list[int], window: int, rank: int, same: bool = False) -> None:
    """DeepSpeed's documented loop: the mean loss, engine.step() after every microbatch (in bf16, its bf16
    accumulation); the short last window forced to its boundary (DeepSpeed would otherwise merge it into the next),
    still divided by gradient_accumulation_steps. ``same``: every microbatch the window's first sequence."""
    for k, valid in enumerate(mine):
        tokens, labels = microbatch(window, rank, 0 if same else k, valid)
        if k == len(mine) - 1:
            engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss_sum(engine, tokens, labels, False) / valid)
        engine.step()
    engine.set_gradient_accumulation_boundary(False)


def _refusals() -> dict[str, Any]:
    """exact() on unsupported engines; a bad weight on rank 0 at finish (both ranks), then a good window."""
    from gradagg.integrations.deepspeed import exact

    out: dict[str, Any] = {}
    for name, stage, steps in (("stage0", 0, 1),):
        try:
            exact(_engine(stage, 0.0, steps))
            out[name] = None
        except Exception as e:  # the test checks the type and the message
            out[name] = (type(e).__name__, str(e))
    engine = _engine(2, 0.0)
    acc = exact(engine)
    rank = dist.get_rank()
    tokens, labels = microbatch(0, rank, 0, 4)
    try:
        with acc.microbatch(weight=float("nan") if rank == 0 else 4.0):
            engine.backward(loss_sum(engine, tokens, labels, False))
        engine.step()
        out["nan_weight"] = None
    except Exception as e:
        out["nan_weight"] = (type(e).__name__, str(e))
    out["steps_after_refusal"] = engine.global_steps
    before = full(engine)
    _exact_window(engine, acc, [[4], [2]], 0, rank, False)
    applied = torch.cat([(before[n] - v).flatten() for n, v in full(engine).items()]) / LR
    truth = _truth(before, [[4], [2]], 0, 0.0, False)
    out["after_refusal_error"] = float((applied - truth).norm() / truth.norm())
    acc.close()
    out["closed"] = not {"step", "backward", "set_gradient_accumulation_boundary"} & set(engine.__dict__)
    out.update(_poisoned())
    return out


def _poisoned() -> dict[str, Any]:
    """One refused window per case, each on both ranks, on one engine: rank 1 back-propagates outside a
    microbatch; rank 1 raises inside one after its backward; rank 0 weighs, rank 1 does not; every weight 0;
    no microbatch on any rank."""
    from gradagg.integrations.deepspeed import exact

    engine, rank = _engine(1, 0.0), dist.get_rank()
    out: dict[str, Any] = {}
    acc = exact(engine)
    tokens, labels = microbatch(0, rank, 0, 4)
    weights = {"outside": (4, 4), "raised": (4, 4), "mixed": (4, None), "zero": (0, 0)}
    for case in ("outside", "raised", "mixed", "zero", "empty"):
        try:
            if case == "outside" and rank == 1:
                engine.backward(loss_sum(engine, tokens, labels, False))  # no acc.microbatch() around it
            if case != "empty":
                with acc.microbatch(weight=weights[case][rank]):
                    engine.backward(loss_sum(engine, tokens, labels, False))
                    if case == "raised" and rank == 1:
                        raise KeyError("boom")
        except KeyError:
            pass
        try:
            engine.step()
            out[case] = None
        except Exception as e:
            out[case] = (type(e).__name__, str(e))
    out["steps_after_poison"] = engine.global_steps
    return out
