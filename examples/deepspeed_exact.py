"""A DeepSpeed ZeRO loop made exact: ``acc = exact(engine)``, the summed loss, ``engine.step()`` per window.

Run:  DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/deepspeed_exact.py [STAGE]
STAGE is the ZeRO stage, 1 (default) or 2; under 3 every rank must run as many microbatches (pad with weight 0).
A tiny token model, right-padded sequences (label -100 = ignore), a different number of microbatches on each
rank in each window (none included); each microbatch back-propagates the SUM of its token losses inside
``acc.microbatch(weight=its tokens)``. Every step's applied gradient (SGD, lr 1: the parameters' change) is
checked against one float64 forward/backward of all ranks' sequences of that window, divided by their tokens.
The config is as users write it (``gradient_accumulation_steps`` 3, ``train_batch_size = 1 x 3 x 2``): each
``engine.step()`` still ends the window, and the divisor is its tokens, never 3.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402

from gradagg.integrations.deepspeed import exact  # noqa: E402

VOCAB, LENGTH, TOLERANCE = 11, 6, 1e-5  # float32 sums of a few dozen token losses against float64: ~1e-7
PLAN = [[[6, 2, 5], [3]], [[], [4, 6]], [[1], [6]]]  # window -> rank -> valid tokens of each microbatch


def batch(window: int, rank: int, k: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * window + 100 * rank + k)
    tokens, labels = torch.randint(0, VOCAB, (2, 1, LENGTH), generator=g)
    labels[:, valid:] = -100
    return tokens, labels


def loss_sum(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def no_shared_memory_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory op at its first ``init_distributed``.

    With a C++ compiler and ninja present, DeepSpeed's CPU accelerator JIT-compiles ``deepspeed_shm_comm`` there:
    minutes on a small machine, for an op that serves only tensor-parallel inference (ZeRO reduces through
    torch.distributed either way). DeepSpeed has no setting for it; its table of the ops this machine can build
    (``deepspeed.ops.__compatible_ops__``, private in DeepSpeed 0.19.8), marked False, is the path it takes where the
    op cannot build. Without that table DeepSpeed compiles as before: slower, the same results.
    """
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def main() -> None:
    no_shared_memory_op()  # before init_distributed, which would compile it
    deepspeed.init_distributed(dist_backend="gloo")
    rank, stage = dist.get_rank(), int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))
    truth_model = copy.deepcopy(model).double()
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config)
    acc = exact(engine)
    for window, per_rank in enumerate(PLAN):
        before = [p.detach().double().clone() for p in engine.module.parameters()]
        for k, valid in enumerate(per_rank[rank]):
            tokens, labels = batch(window, rank, k, valid)
            with acc.microbatch(weight=valid):
                engine.backward(loss_sum(engine, tokens, labels))
        engine.step()  # the window closes here: one optimizer step, on every rank
        applied = [b - p.detach().double() for b, p in zip(before, engine.module.parameters())]
        truth_model.load_state_dict({n: b for n, b in zip(truth_model.state_dict(), before)})
        truth_model.zero_grad()
        for r, counts in enumerate(per_rank):
            for k, valid in enumerate(counts):
                loss_sum(truth_model, *batch(window, r, k, valid)).backward()
        tokens_total = sum(v for counts in per_rank for v in counts)
        error = max(float((a - t.grad / tokens_total).abs().max()) for a, t in zip(applied, truth_model.parameters()))
        if rank == 0:
            print(f"window {window}: {[len(c) for c in per_rank]} microbatches, {tokens_total} tokens, "
                  f"D = {acc.ledger.divisor if acc.ledger else None}, max error {error:.1e}")
        assert error < TOLERANCE, error


if __name__ == "__main__":
    main()
