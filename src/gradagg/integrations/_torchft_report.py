"""What :mod:`gradagg.integrations.torchft` reports of each step, on each rank: applied or not, why, and what.

Its own module so that the window's cross-group sums (:mod:`gradagg.integrations.torchft`) stay one concern;
imported from there (``gradagg.integrations.torchft.StepReport``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepReport:
    """One step as one rank of one replica group saw it.

    Attributes:
        step: torchft's step (``manager.current_step()``) of the last attempt: the step the gradients are for.
        group: the name given to :func:`exact` (torchft's replica id, typically).
        committed: ``should_commit()`` said True: the gradients hold the step's exact mean; step the optimizer.
        participating: this group's window went into the last attempt's sums (False while healing, for a stale
            window, or after an error).
        group_microbatches: the microbatches this group ran in the window (over its ranks).
        group_weight: their total weight (tokens); None without weights.
        microbatches: the microbatches summed over the groups that contributed (None if the all-reduce failed).
        weight: their total weight: the divisor of a weighted step (None without weights or on failure).
        per_participant: (weight or microbatches) per quorum slot, the groups that contributed; ``()`` on failure.
        divisor: what the gradients were divided by (None when nothing was divided).
        keys: the keys of this rank's microbatches in the window, in order.
        skipped: the keys that no committed step applied: ``keys`` unless :attr:`applied_in` is set.
        reason: why the window was not applied ("" when it was).
        applied_in: the committed step whose mean holds this window: ``step``, or an earlier step that the other
            groups committed while this group's own commit failed (it learns so when the retry heals it); None when
            no committed step holds it.
        attempts: how many times the window went through torchft's all-reduce (more than 1 after a retry).

    >>> StepReport(step=3, group="g0", committed=False, participating=True, group_microbatches=2,
    ...            group_weight=7.0, keys=("a", "b"), skipped=("a", "b"), reason="should_commit() was False").text()
    'step 3, group g0: NOT applied (should_commit() was False): 2 microbatches, weight 7 skipped: keys a, b'
    """

    step: int
    group: str
    committed: bool
    participating: bool
    group_microbatches: int
    group_weight: float | None
    microbatches: int | None = None
    weight: float | None = None
    per_participant: tuple[float, ...] = ()
    divisor: float | None = None
    keys: tuple[Hashable, ...] = ()
    skipped: tuple[Hashable, ...] = ()
    reason: str = ""
    applied_in: int | None = None
    attempts: int = 1

    @property
    def applied(self) -> bool:
        """This group's window is in a committed step."""
        return not self.reason

    def text(self) -> str:
        """One line for a log: applied or not, why, and what.

        Returns:
            The line.
        """
        w = "" if self.group_weight is None else f", weight {self.group_weight:g}"
        what = f"{self.group_microbatches} microbatches{w}"
        tries = "" if self.attempts == 1 else f" ({self.attempts} attempts)"
        if not self.applied:
            keys = ", ".join(str(k) for k in self.skipped)
            head = f"step {self.step}, group {self.group}: NOT applied ({self.reason}){tries}"
            return f"{head}: {what} skipped: keys {keys}"
        if self.applied_in is not None and self.applied_in != self.step:
            return (f"step {self.step}, group {self.group}: {what} applied in step {self.applied_in} by the other "
                    f"groups{tries}; this group healed to step {self.step}")
        return f"step {self.step}, group {self.group}: applied {what}{tries}; step divided by {self.divisor:g}"


__all__ = ["StepReport"]
