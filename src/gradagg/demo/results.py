"""What the ranks hand back and the report reads: per-step records per case (plain values, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

GRADAGG = "gradagg"
# float64 round-off: gradagg and the ground truth add the same M terms (or N token terms), each of order 1,
# in different orders, which moves the result by a few ulps per term: ~100 * 2.2e-16 at most here. 1e-12
# leaves a margin of ~50 while staying far below the wrong approaches' errors (1e-3 and up).
TOLERANCE = 1e-12


@dataclass(frozen=True)
class ApproachInfo:
    """One way of combining the ranks' gradients, as the report shows it.

    Attributes:
        name: the row label of the summary table.
        short: the column label of the per-step table (at most 11 characters).
        why: one line: what it computes, and for a wrong approach why that is wrong.
    """

    name: str
    short: str
    why: str


@dataclass
class StepRecord:
    """One step, every approach: held-out loss before the step, max |grad - truth|, which parameters were off."""

    step: int
    loss: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    off: dict[str, list[str]] = field(default_factory=dict)  # parameters whose error exceeds the tolerance
    scale: float = 0.0  # the largest |entry| of gradagg's ground-truth gradient: what its error compares with


@dataclass
class CaseResult:
    """One case's run on one rank (errors already maxima over ranks).

    Attributes:
        case: ``"tokens"`` or ``"moe"``.
        title: what the case is, one line.
        details: lines describing the model, the data and the ground truth.
        approaches: gradagg first, then the wrong approaches.
        records: one per step.
        final_loss: held-out loss after the last step, per approach.
        ledger: gradagg's accumulation ledger of step 0, as text.
        train_s: seconds spent training this case.
    """

    case: str
    title: str
    details: list[str]
    approaches: tuple[ApproachInfo, ...]
    records: list[StepRecord]
    final_loss: dict[str, float]
    ledger: str
    train_s: float = 0.0

    def max_error(self, name: str) -> float:
        """The largest error of approach ``name`` over the steps.

        >>> steps = [StepRecord(0, error={"a": 1.0}), StepRecord(1, error={"a": 3.0})]
        >>> r = CaseResult("moe", "", [], (), steps, {}, "")
        >>> r.max_error("a")
        3.0
        """
        return max(r.error[name] for r in self.records)


@dataclass
class Outcome:
    """What a rank hands back: one :class:`CaseResult` per case run, and where the world was."""

    cases: list[CaseResult]
    wrap: str
    world_size: int

    @property
    def train_s(self) -> float:
        """Seconds spent training, start-up of the world excluded."""
        return sum(c.train_s for c in self.cases)


def passed(outcome: Outcome) -> bool:
    """Whether gradagg stayed within :data:`TOLERANCE` of the ground truth at every step of every case.

    Args:
        outcome: what the ranks measured.

    Returns:
        True when gradagg was exact everywhere.

    >>> ok = CaseResult("moe", "", [], (), [StepRecord(0, error={GRADAGG: 1e-16})], {}, "")
    >>> passed(Outcome([ok], "none", 2))
    True
    """
    return all(c.max_error(GRADAGG) <= TOLERANCE for c in outcome.cases)
