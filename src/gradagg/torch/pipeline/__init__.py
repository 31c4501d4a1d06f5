"""Pipeline parallelism (``torch.distributed.pipelining``) with a counted token divisor.

Vocabulary: a **stage** is a piece of the model on one rank (several with interleaved schedules); a
**pipeline** is the group of ranks holding every stage once; a **replica** is one pipeline among the
data-parallel copies; a stage's **data-parallel group** holds its replicas. The **count** of a microbatch
is the number of tokens its loss summed, taken by the last stage (the only one that sees the labels); the
**divisor** D is the sum of the counts over all microbatches of all replicas. After a step, every stage's
gradients are (sum over its replicas of the summed-loss gradients) / D: the same D on every stage, counted
once. A **padding** microbatch counts 0 (present, weight zero); a parameter with no gradient on any replica
is **absent** and stays None; a NaN gradient stays NaN. The last stage counts as the accumulator counts its
weights (:mod:`gradagg.torch.accumulate.counting`): a count that cannot count (NaN, Inf, negative) is refused
on every rank, in the accumulator's words; the step's :class:`PipelineLedger` is its
:class:`~gradagg.torch.accumulate.ledger.Ledger`, the replicas standing for the ranks.

torch's schedules need the same number of microbatches on every stage of a pipeline per ``step`` call; the
replicas may differ (each is its own pipeline, and gradagg reduces over the replicas after the step), or a
replica with fewer can pad with count-0 microbatches.
"""

from __future__ import annotations

from gradagg.torch.pipeline.accumulator import PipelineAccumulator
from gradagg.torch.pipeline.ledger import PipelineLedger

__all__ = ["PipelineAccumulator", "PipelineLedger"]
