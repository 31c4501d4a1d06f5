"""The counts of a pipelined step: taken where the labels are (the last stage), summed once, known everywhere.

Only the last stage runs the loss, so only it can count. It counts as the accumulator does
(:mod:`gradagg.torch.accumulate.counting`): each microbatch's count taken when the loss function returns it
(:func:`~gradagg.torch.accumulate.counting.check_weight`: copied, a tensor on its device), the step's counts
read once, the first that cannot count named by its microbatch, and summed exactly
(:class:`~gradagg.torch.accumulate.counting.Tally`). What only a pipeline does is where the count goes next.
As Megatron's ``finalize_model_grads`` broadcasts ``num_tokens`` from the last stage, the first all_reduce
below runs over the pipeline group, in which every other stage contributes zeros: a broadcast written as a sum,
which also shows how many stages claimed to be last. The second runs over the data-parallel group, each
replica's numbers in a slot of their own (so the ledger has them per replica) and one presence flag per
parameter after them (absent on every replica stays None; absent on some is written as zeros). The slot also
says which dtypes the ranks' gradients are divided in, so that every rank checks D against each of them (a D
beyond float32 divides a float32 gradient to 0), though its own stage holds one. Two small collectives per
step, whatever the model's size, and one read back of their result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradagg.errors import GradaggError
from gradagg.torch.accumulate.counting import Read, Tally, Weight, check_weight, weight_sum
from gradagg.torch.collectives import Group, all_reduce_sum, device_for, get_rank, get_world_size

# One replica's slot: tokens, microbatches, padding (count 0), last stages, loss sum, counts that cannot count,
# stale ranks, microbatches whose loss function failed (or a schedule that raised); then, per dtype of _DIVIDED, the
# ranks with a gradient in it.
TOKENS, MICROBATCHES, PADDING, LASTS, LOSS, INVALID, STALE, FAILED, DTYPES = range(9)
_DIVIDED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the real dtypes a gradient is divided in
_FIELDS = DTYPES + len(_DIVIDED)
_NOTHING = Read((), None, 0.0)


class Counts:
    """What this rank's last stage counted during one step, in the order its microbatches ran."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.failed: list[str] = []  # what went wrong in each microbatch whose loss function failed, in order
        self.read: Read = _NOTHING  # the kept counts, read once (:meth:`keep`)
        self._calls: list[tuple[torch.Tensor, Weight]] = []
        self._failures: dict[int, tuple[torch.Tensor, str]] = {}

    def clear(self) -> None:
        self.losses.clear()
        self.failed.clear()
        self.read = _NOTHING
        self._calls.clear()
        self._failures.clear()

    def record_failure(self, substitute: torch.Tensor, what: str) -> None:
        """A loss function call that failed: ``substitute`` (a zero loss) ran in its place; ``what`` says why."""
        self._failures[id(substitute)] = (substitute, what)

    def record(self, loss_sum: torch.Tensor, count: object) -> None:
        """Keep one call's loss and count (taken now, as the accumulator takes a weight); a loss the schedule
        cannot back-propagate, or a count that is not one real number, raises GradaggError (the wrapped loss
        turns it into a failed microbatch). A count that cannot count (NaN, negative, ...) is named by
        :meth:`keep`'s read, and the step refuses it on every rank."""
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1 or not loss_sum.requires_grad:
            shown = f"shape {tuple(loss_sum.shape)}, requires_grad={loss_sum.requires_grad}" if isinstance(
                loss_sum, torch.Tensor) else type(loss_sum).__name__
            raise GradaggError(f"the loss must be a one-element tensor with a gradient, got {shown}")
        # A one-element tensor of any shape is its one number (a sum taken with keepdim=True); check_weight copies
        # it: a count tensor the loss function reuses for the next microbatch counts the value it held here.
        if isinstance(count, torch.Tensor) and count.numel() == 1:
            count = count.reshape(())
        self._calls.append((loss_sum, check_weight(count)))

    def keep(self, losses: list[torch.Tensor]) -> None:
        """Keep the calls whose loss the schedule returned, in its microbatch order, drop the rest, and read the
        counts kept (one device read on the last stage; none elsewhere).

        On its first step a ``PipelineStage`` built without ``input_args``/``output_args`` infers shapes
        by running the stage and the loss once on uninitialised tensors of the first microbatch's shape
        (``_backward_metadata_inference``, torch 2.13): that call's count is not a microbatch's. The
        schedule's public ``losses`` list holds exactly the losses of the real microbatches, the very
        tensors the loss function returned, so identity tells the two apart.
        """
        by_id = {id(loss): count for loss, count in self._calls}
        kept = [(loss, by_id[id(loss)]) for loss in losses if id(loss) in by_id]
        self.losses = [loss.detach().reshape(()).to(torch.float64) for loss, _ in kept]
        self.read = Tally([count for _, count in kept]).read()
        self.failed = [f"microbatch {k}: {self._failures[id(loss)][1]}" for k, loss in enumerate(losses)
                       if id(loss) in self._failures]  # the shape-inference call's failures are not kept
        self._calls.clear()
        self._failures.clear()

    def problems(self) -> list[str]:
        """What this rank could not count: each failed loss function call, then the first count that cannot count
        (in the accumulator's words, :func:`~gradagg.torch.accumulate.counting.weight_problem`)."""
        counts = [] if self.read.problem is None else [f"the loss function's counts: {self.read.problem}"]
        return self.failed + counts


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
    dtypes: tuple[torch.dtype, ...] = ()
    """The dtypes the gradients present on any rank of any stage are divided in."""

    @property
    def divisor(self) -> float:
        """D: the replicas' counts summed exactly, rounded once (infinite beyond float64)."""
        return weight_sum(list(self.tokens))


def reduce_counts(counts: Counts, last: bool, stale: bool, present: list[bool], dtypes: set[torch.dtype], pp: Group,
                  dp: Group, pipeline: bool = True) -> Totals:
    """Sum this rank's counts over its pipeline, then gather them per replica (two all_reduce calls). ``dtypes``:
    those of this rank's gradients (the stages' may differ: every rank checks D against every stage's).
    ``pipeline=False`` (a rank whose schedule raised, telling the other replicas): the second only."""
    device = device_for(pp)
    local = _local(counts, last, stale, device)
    real = {d.to_real() for d in dtypes}
    local[DTYPES:] = torch.tensor([1.0 if d in real else 0.0 for d in _DIVIDED], dtype=torch.float64)
    if pipeline:
        all_reduce_sum(local, pp)
    width, slot = get_world_size(dp), get_rank(dp)
    buf = torch.zeros(_FIELDS * width + len(present), dtype=torch.float64, device=device_for(dp))
    buf[_FIELDS * slot:_FIELDS * (slot + 1)] = local.to(buf.device)
    buf[_FIELDS * width:] = torch.tensor([1.0 if p else 0.0 for p in present], dtype=torch.float64)
    all_reduce_sum(buf, dp)
    values = buf.tolist()  # the one read back of the collectives
    col = list(zip(*(values[_FIELDS * r:_FIELDS * (r + 1)] for r in range(width))))

    def ints(field: int) -> tuple[int, ...]:
        return tuple(int(x) for x in col[field])

    return Totals(
        tokens=tuple(col[TOKENS]), microbatches=ints(MICROBATCHES), padding=ints(PADDING), lasts=ints(LASTS),
        loss=float(sum(col[LOSS])), invalid=ints(INVALID), stale=ints(STALE),
        present=tuple(v != 0 for v in values[_FIELDS * width:]), failed=ints(FAILED),
        dtypes=tuple(d for k, d in enumerate(_DIVIDED) if any(col[DTYPES + k])),
    )


def _local(counts: Counts, last: bool, stale: bool, device: torch.device) -> torch.Tensor:
    """This rank's slot: zeros but for the stale and failed flags on a rank without the last stage."""
    out = [0.0] * _FIELDS
    out[STALE] = 1.0 if stale else 0.0
    out[FAILED] = float(len(counts.failed))  # a loss function's failures (last stage), or the schedule's (any stage)
    if last:
        read = counts.read
        out[LASTS] = 1.0
        out[MICROBATCHES] = float(len(read.values))
        out[PADDING] = float(sum(v == 0 for v in read.values))
        # A count that cannot count (NaN, Inf, negative) is named, never summed: NaN must not pass for a count.
        out[INVALID] = 0.0 if read.problem is None else 1.0
        out[TOKENS] = read.total if read.problem is None else 0.0
    slot = torch.tensor(out, dtype=torch.float64, device=device)
    if last and counts.losses:
        slot[LOSS] = torch.stack(counts.losses).to(device).sum()  # on the device: no read here
    return slot


def local_tokens(counts: Counts, last: bool) -> tuple[float, ...] | None:
    """This rank's per-microbatch counts for the ledger (None: no last stage here, so nothing counted)."""
    return counts.read.values if last else None
