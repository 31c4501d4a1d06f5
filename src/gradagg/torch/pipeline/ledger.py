"""What one pipelined step counted: the :class:`PipelineLedger` that :meth:`PipelineAccumulator.step` returns.

It is the accumulator's :class:`~gradagg.torch.accumulate.ledger.Ledger`, its fields in a pipeline's meaning
(the data-parallel replicas stand where the ranks of a window stand: a replica is one pipeline, whose last stage
counts for it), and the few fields only a pipeline has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from gradagg.torch.accumulate.ledger import Ledger, number_text


@dataclass(frozen=True, kw_only=True)
class PipelineLedger(Ledger):
    """What one pipelined step counted, the same global fields on every rank of every stage.

    The :class:`~gradagg.torch.accumulate.ledger.Ledger`'s fields, where a replica stands for a rank:

    - ``rank``, ``world_size``: this rank's replica (its rank in the data-parallel group) and the replicas;
    - ``microbatches_local``: the microbatches of this rank's replica (every stage of a pipeline runs them all);
      ``microbatches_per_rank``: per replica; ``microbatches_global``: their sum;
    - ``weighting`` is ``"weighted"``: each microbatch counts for its count (the tokens its loss summed);
      ``weight_local``: this replica's total count; ``weight_per_rank``: each replica's (as counted by its last
      stage); ``weight_global`` = ``divisor``: D, what every stage's summed gradients were divided by;
    - ``participation_local`` and ``participation_global`` are empty: the schedule runs the backwards, so a
      parameter's presence is known per step only (``absent``);
    - ``span``: the data-parallel group's global ranks (a stage's gradients are reduced over it).

    Attributes:
        pp_rank: this rank in the pipeline group.
        stages: the stage indices this rank runs.
        last: whether this rank runs the last stage (the one that saw the labels and counted).
        tokens_local: the count of each microbatch, as this rank's last stage took it from the loss;
            None on a rank without the last stage (absent, not zero: it counted nothing).
        padding_per_replica: of each replica's microbatches, how many counted 0 (padding: present, weight zero).
        loss: the global mean loss, (sum over replicas of the summed losses) / D; NaN if a loss was NaN.
        absent: parameters (``"stage{i}.{name}"``) without a gradient on any replica: left None.
        tied: the tied weights reduced across stages, by the names they were declared under.

    >>> ledger = PipelineLedger(rank=0, world_size=2, microbatches_local=2, microbatches_global=3,
    ...                         microbatches_per_rank=(2, 1), divisor=5.0, weight_local=4.0, weight_per_rank=(4.0, 1.0),
    ...                         weight_global=5.0, pp_rank=0, stages=(0,), last=False, tokens_local=None,
    ...                         padding_per_replica=(0, 0), loss=1.5)
    >>> ledger.tokens_per_replica, ledger.microbatches_per_replica
    ((4.0, 1.0), (2, 1))
    >>> print(ledger.report().splitlines()[2])
    divisor D = total weight = 5 (per replica: [4, 1])
    """

    participation_local: dict[str, int] = field(default_factory=dict)
    participation_global: dict[str, int] | None = field(default_factory=dict)
    weighting: str = "weighted"
    pp_rank: int
    stages: tuple[int, ...]
    last: bool
    tokens_local: tuple[float, ...] | None
    padding_per_replica: tuple[int, ...]
    loss: float
    absent: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    _per: ClassVar[str] = "replica"

    @property
    def tokens_per_replica(self) -> tuple[float, ...]:
        """Each data-parallel replica's total count (its pipeline's last stage's): ``weight_per_rank``."""
        return self.weight_per_rank or ()

    @property
    def microbatches_per_replica(self) -> tuple[int, ...]:
        """Microbatches each replica's last stage ran: ``microbatches_per_rank``."""
        return self.microbatches_per_rank or ()

    def report(self) -> str:
        """A readable summary of the step: the divisor and what it counted, per replica.

        Returns:
            Several lines of text.
        """
        local = "not the last stage: counted nothing" if self.tokens_local is None else (
            f"counted [{', '.join(number_text(t) for t in self.tokens_local)}] per microbatch")
        lines = [
            f"pipelined step, pp rank {self.pp_rank}, dp rank {self.rank} of {self.world_size}, "
            f"stages {list(self.stages)}: {local}",
            self._counts_line(),
            *self._divisor_lines(),
            "counted once, on each replica's last stage (the one that sees the labels)",
            f"of which padding (count 0) per replica: {list(self.padding_per_replica)}",
            *self.span.text(),
            f"loss (sum / D): {self.loss!r}",
        ]
        if self.tied:
            lines.append(f"tied across stages, gradients summed: {', '.join(self.tied)}")
        if self.absent:
            lines.append(f"absent on every replica (gradient left None): {', '.join(self.absent)}")
        return "\n".join(lines)
