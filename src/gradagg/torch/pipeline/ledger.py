"""What one pipelined step counted: the :class:`PipelineLedger` that :meth:`PipelineAccumulator.step` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineLedger:
    """What one pipelined step counted, the same global fields on every rank of every stage.

    Attributes:
        rank: this process's rank in the pipeline group and in the data-parallel group, ``(pp, dp)``.
        stages: the stage indices this rank runs.
        last: whether this rank runs the last stage (the one that saw the labels and counted).
        tokens_local: the count of each microbatch, as this rank's last stage took it from the loss;
            None on a rank without the last stage (absent, not zero: it counted nothing).
        tokens_per_replica: each data-parallel replica's total count (its pipeline's last stage's).
        microbatches_per_replica: microbatches each replica's last stage ran.
        padding_per_replica: of those, how many counted 0 (padding microbatches: present, weight zero).
        divisor: D, the total count over all replicas, what every stage's summed gradients were divided by.
        loss: the global mean loss, (sum over replicas of the summed losses) / D; NaN if a loss was NaN.
        absent: parameters (``"stage{i}.{name}"``) without a gradient on any replica: left None.
        tied: the tied weights reduced across stages, by the names they were declared under.

    >>> PipelineLedger(rank=(0, 0), stages=(0,), last=False, tokens_local=None, tokens_per_replica=(5.0,),
    ...                microbatches_per_replica=(2,), padding_per_replica=(0,), divisor=5.0, loss=1.5,
    ...                absent=(), tied=()).divisor
    5.0
    """

    rank: tuple[int, int]
    stages: tuple[int, ...]
    last: bool
    tokens_local: tuple[float, ...] | None
    tokens_per_replica: tuple[float, ...]
    microbatches_per_replica: tuple[int, ...]
    padding_per_replica: tuple[int, ...]
    divisor: float
    loss: float
    absent: tuple[str, ...]
    tied: tuple[str, ...]

    def report(self) -> str:
        """A readable summary of the step: the divisor and what it counted, per replica.

        Returns:
            Several lines of text.
        """
        local = "not the last stage: counted nothing" if self.tokens_local is None else (
            f"counted {[_num(t) for t in self.tokens_local]} per microbatch")
        lines = [
            f"pipelined step, pp rank {self.rank[0]}, dp rank {self.rank[1]}, stages {list(self.stages)}: {local}",
            f"divisor D = total count = {_num(self.divisor)} (per replica: "
            f"[{', '.join(_num(t) for t in self.tokens_per_replica)}]), counted once, on each last stage",
            f"microbatches per replica: {list(self.microbatches_per_replica)}, "
            f"of which padding (count 0): {list(self.padding_per_replica)}",
            f"loss (sum / D): {self.loss!r}",
        ]
        if self.tied:
            lines.append(f"tied across stages, gradients summed: {', '.join(self.tied)}")
        if self.absent:
            lines.append(f"absent on every replica (gradient left None): {', '.join(self.absent)}")
        return "\n".join(lines)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))
