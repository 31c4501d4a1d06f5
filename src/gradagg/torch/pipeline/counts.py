"""The counts of a pipelined step: taken where the labels are (the last stage), summed once, known everywhere.

Only the last stage runs the loss, so only it can count. As Megatron's ``finalize_model_grads`` broadcasts
``num_tokens`` from the last stage, the first all_reduce below runs over the pipeline group, in which every
other stage contributes zeros: a broadcast written as a sum, which also shows how many stages claimed to be
last. The second runs over the data-parallel group, each replica's numbers in a slot of their own (so the
ledger has them per replica) and one presence flag per parameter after them (absent on every replica stays
None; absent on some is written as zeros). Two small collectives per step, whatever the model's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradagg.errors import GradaggError, first_line
from gradagg.torch.collectives import Group, all_reduce_sum, device_for, get_rank, get_world_size

# One replica's slot: tokens, microbatches, padding (count 0), last stages, loss sum, invalid counts, stale ranks,
# microbatches whose loss function failed.
_FIELDS = 8


class Counts:
    """What this rank's last stage counted during one step, in the order its microbatches ran."""

    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []
        self.failed: list[str] = []  # what went wrong in each microbatch whose loss function failed, in order
        self._calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._failures: dict[int, tuple[torch.Tensor, str]] = {}

    def clear(self) -> None:
        self.tokens.clear()
        self.losses.clear()
        self.failed.clear()
        self._calls.clear()
        self._failures.clear()

    def record_failure(self, substitute: torch.Tensor, what: str) -> None:
        """A loss function call that failed: ``substitute`` (a zero loss) ran in its place; ``what`` says why."""
        self._failures[id(substitute)] = (substitute, what)

    def record(self, loss_sum: torch.Tensor, count: torch.Tensor | float) -> None:
        """Keep one call's loss and count; a loss the schedule cannot back-propagate, or a count that is not
        one number, raises GradaggError (the wrapped loss turns it into a failed microbatch)."""
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1 or not loss_sum.requires_grad:
            shown = f"shape {tuple(loss_sum.shape)}, requires_grad={loss_sum.requires_grad}" if isinstance(
                loss_sum, torch.Tensor) else type(loss_sum).__name__
            raise GradaggError(f"the loss must be a one-element tensor with a gradient, got {shown}")
        try:
            value = torch.as_tensor(count).detach().reshape(())
        except (RuntimeError, TypeError, ValueError) as exc:
            raise GradaggError(f"the count must be one number, got {first_line(exc)}") from None
        # Kept as tensors: a .item() here would be one device-to-host sync per microbatch. A copy, always: a
        # count tensor the loss function reuses and overwrites for the next microbatch must count the value it
        # held when given (``.to(float64)`` of a float64 tensor, or ``reshape`` of one of shape (1,), is the same
        # storage).
        self._calls.append((loss_sum, value.to(torch.float64, copy=True)))

    def keep(self, losses: list[torch.Tensor]) -> None:
        """Keep the calls whose loss the schedule returned, in its microbatch order, and drop the rest.

        On its first step a ``PipelineStage`` built without ``input_args``/``output_args`` infers shapes
        by running the stage and the loss once on uninitialised tensors of the first microbatch's shape
        (``_backward_metadata_inference``, torch 2.13): that call's count is not a microbatch's. The
        schedule's public ``losses`` list holds exactly the losses of the real microbatches, the very
        tensors the loss function returned, so identity tells the two apart.
        """
        by_id = {id(loss): count for loss, count in self._calls}
        kept = [(loss, by_id[id(loss)]) for loss in losses if id(loss) in by_id]
        self.losses = [loss.detach().reshape(()).to(torch.float64) for loss, _ in kept]
        self.tokens = [count for _, count in kept]
        self.failed = [f"microbatch {k}: {self._failures[id(loss)][1]}" for k, loss in enumerate(losses)
                       if id(loss) in self._failures]  # the shape-inference call's failures are not kept
        self._calls.clear()
        self._failures.clear()


@dataclass(frozen=True)
class Totals:
    """The step's counts, per data-parallel replica, the same on every rank."""

    tokens: tuple[float, ...]
    microbatches: tuple[int, ...]
    padding: tuple[int, ...]
    lasts: tuple[int, ...]
    loss: float
    invalid: tuple[int, ...]
    stale: tuple[int, ...]
    present: tuple[bool, ...]
    failed: tuple[int, ...] = ()

    @property
    def divisor(self) -> float:
        return float(sum(self.tokens))


def reduce_counts(counts: Counts, last: bool, stale: bool, present: list[bool], pp: Group, dp: Group) -> Totals:
    """Sum this rank's counts over its pipeline, then gather them per replica (two all_reduce calls)."""
    device = device_for(pp)
    local = _local(counts, last, stale, device)
    all_reduce_sum(local, pp)
    width, slot = get_world_size(dp), get_rank(dp)
    buf = torch.zeros(_FIELDS * width + len(present), dtype=torch.float64, device=device_for(dp))
    buf[_FIELDS * slot:_FIELDS * (slot + 1)] = local.to(buf.device)
    buf[_FIELDS * width:] = torch.tensor([1.0 if p else 0.0 for p in present], dtype=torch.float64)
    all_reduce_sum(buf, dp)
    table = buf[:_FIELDS * width].reshape(width, _FIELDS).tolist()  # the one read back of the step
    col = list(zip(*table))
    return Totals(
        tokens=tuple(col[0]), microbatches=tuple(int(x) for x in col[1]), padding=tuple(int(x) for x in col[2]),
        lasts=tuple(int(x) for x in col[3]), loss=float(sum(col[4])), invalid=tuple(int(x) for x in col[5]),
        stale=tuple(int(x) for x in col[6]), present=tuple(v != 0 for v in buf[_FIELDS * width:].tolist()),
        failed=tuple(int(x) for x in col[7]),
    )


def _local(counts: Counts, last: bool, stale: bool, device: torch.device) -> torch.Tensor:
    """This rank's slot: zeros but for the stale flag on a rank without the last stage."""
    out = torch.zeros(_FIELDS, dtype=torch.float64, device=device)
    out[6] = 1.0 if stale else 0.0
    if not last:
        return out
    out[3] = 1.0
    out[7] = float(len(counts.failed))
    if not counts.tokens:
        return out
    c = torch.stack(counts.tokens).to(device)
    valid = torch.isfinite(c) & (c >= 0)
    # An invalid count (NaN, Inf, negative) is reported, never summed: NaN must not pass for a count.
    out[0] = torch.where(valid, c, torch.zeros_like(c)).sum()
    out[1] = float(len(counts.tokens))
    out[2] = (c == 0).sum()
    out[4] = torch.stack(counts.losses).to(device).sum()
    out[5] = (~valid).sum()
    return out


def local_tokens(counts: Counts, last: bool) -> tuple[float, ...] | None:
    """This rank's per-microbatch counts for the ledger (None: no last stage here, so nothing counted)."""
    if not last:
        return None
    return tuple(torch.stack(counts.tokens).tolist()) if counts.tokens else ()
