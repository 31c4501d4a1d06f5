"""What the Accelerate and Lightning workers share: a rank's launcher environment, indexed data, per-step truth.

Each optimizer step is recorded as (the parameters at the step's start, the global indices of the sequences the
step consumed on all ranks, the gradient the optimizer saw); :func:`step_errors` compares each gradient with the
float64 one-process full-batch token mean of exactly those sequences (clipped when ``clip`` is given, with the
formula of ``torch.nn.utils.clip_grad_norm_``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tests.integrations import tiny_llama as tl

SEQUENCES = 20  # 10 microbatches of 2: 5 per rank, windows of 3 and then a short last one of 2
PER_MICROBATCH = 2
STEPS = 3  # gradient_accumulation_steps / accumulate_grad_batches
EPOCHS = 2  # the second epoch's first window must start afresh after the first epoch's short one


def launcher_env() -> None:
    """The variables ``torchrun`` would set, for a rank of a world the harness already initialised.

    The frameworks read them to see a launcher's world (Lightning: TORCHELASTIC_RUN_ID) and then join the
    existing process group instead of starting processes or a group of their own.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",
                      TORCHELASTIC_RUN_ID="gradagg-test")


class Indexed(torch.utils.data.Dataset[int]):
    """The global sequence indices 0..n-1 (the sequences themselves come from ``tiny_llama.sequences``)."""

    def __init__(self, n: int = SEQUENCES) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


SEQS = tl.sequences(seed=7, count=SEQUENCES)


def collate(indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """A right-padded microbatch and its global indices (``idx``, to pop before the forward)."""
    out = tl.collate([SEQS[i] for i in indices])
    out["idx"] = torch.tensor(list(indices))
    return out


@dataclass
class Recorder:
    """One rank's record of the steps: parameters at each step's start, indices consumed, gradients seen."""

    starts: list[dict[str, torch.Tensor]] = field(default_factory=list)
    indices: list[list[int]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)

    def begin(self, model: torch.nn.Module) -> None:
        """Call at the first microbatch of a window (before its backward)."""
        self.starts.append({n: _full(t) for n, t in model.state_dict().items()})

    def saw(self, idx: torch.Tensor) -> None:
        self.pending.extend(int(i) for i in idx)

    def stepped(self, model: torch.nn.Module) -> None:
        """Call where the optimizer would step: the gradient it sees (full tensors under FSDP2)."""
        self.grads.append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        self.indices.append(self.pending)
        self.pending = []


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def step_errors(rec: Recorder, clip: float | None, seqs: Sequence[dict[str, list[int]]] = SEQS) -> dict[str, Any]:
    """On every rank: each step's relative error against the truth (computed on rank 0), and the true norms;
    ``seqs``: the sequences the recorded indices name."""
    every: list[list[list[int]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, rec.indices)
    if dist.get_rank() != 0:
        return {}
    errors, norms, sizes = [], [], []
    for s, (start, grads) in enumerate(zip(rec.starts, rec.grads, strict=True)):
        consumed = sorted(i for rank_steps in every for i in rank_steps[s])
        want, norm = _truth(start, [seqs[i] for i in consumed], clip)
        errors.append(tl.relative_error(grads, want))
        norms.append(norm)
        sizes.append(len(consumed))
    return {"errors": errors, "true_norms": norms, "sequences": sizes}


def _truth(start: dict[str, torch.Tensor], consumed: list[dict[str, list[int]]], clip: float | None
           ) -> tuple[dict[str, torch.Tensor], float]:
    m = tl.model(0)
    m.load_state_dict(start)
    want = tl.truth(m, consumed)
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()])))
    if clip is not None:
        coef = min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
        want = {n: g * coef for n, g in want.items()}
    return want, norm
