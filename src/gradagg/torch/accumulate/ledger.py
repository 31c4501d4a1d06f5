"""What one accumulation window counted: the :class:`Ledger` that :meth:`MicrobatchAccumulator.finish` returns.

Vocabulary (see :mod:`gradagg.reference`): a **microbatch** is one forward/backward pass; M is how many
ran on all ranks; a microbatch's **weight** is what it counts for in the divisor (typically its number of
valid tokens; 1 without weights); the **divisor** D is what the summed gradients were divided by: M
without weights, the total weight with weights, 1 when the loss terms were divided ahead of time
(:meth:`~gradagg.torch.MicrobatchAccumulator.divisors`); **participation** is in how many microbatches a
parameter got a gradient (reported, never a divisor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

NONE, UNWEIGHTED, WEIGHTED, DIVIDED, TERMS = range(5)
"""How a rank's window was counted: the code that travels in the window's collective."""
WEIGHTING = ("none", "unweighted", "weighted", "divided ahead", "terms")
"""The name of each weighting code (``WEIGHTING[WEIGHTED] == "weighted"``): what the :class:`Ledger` reports."""


@dataclass(frozen=True)
class Span:
    """Which ranks a window was counted and reduced over, and the device-mesh dims they span.

    Attributes:
        ranks: the global ranks of the accumulator's group, sorted (``(0,)`` with no process group).
        counted_over: the mesh dims the divisor was counted over (``("dp", "cp")``); ``()`` without ``mesh=``.
        reduced_over: under FSDP2, its mesh's dims, over which the sharded gradients are summed (FSDP's own mean
            never taken) and then divided once by D; ``()`` where gradagg reduces over the group counted over.

    >>> Span(ranks=(0, 1, 2, 3), counted_over=("dp", "cp")).text()
    ['counted and reduced over dp x cp: global ranks [0, 1, 2, 3]']
    """

    ranks: tuple[int, ...] = (0,)
    counted_over: tuple[str, ...] = ()
    reduced_over: tuple[str, ...] = ()

    def text(self) -> list[str]:
        """The report's lines: which group counted, which reduced (none for one process without a mesh)."""
        if not self.counted_over and self.ranks == (0,):
            return []
        over = f"{' x '.join(self.counted_over)}: " if self.counted_over else "the group of "
        if not self.reduced_over:
            return [f"counted and reduced over {over}global ranks {list(self.ranks)}"]
        return [
            f"counted over {over}global ranks {list(self.ranks)}",
            f"reduced over {' x '.join(self.reduced_over)}, FSDP2's mesh: summed (FSDP's own mean not taken), divided "
            "once by D",
        ]


@dataclass(frozen=True)
class Ledger:
    """What one accumulation window counted. Global fields are None until :meth:`~MicrobatchAccumulator.finish`.

    Attributes:
        rank: this process's rank in the group (0 with no group).
        world_size: ranks in the group (1 with no group).
        microbatches_local: microbatches completed on this rank.
        microbatches_global: M, the microbatches completed on all ranks.
        microbatches_per_rank: M split by rank.
        divisor: D, what the summed gradients were actually divided by: M without weights, the total
            weight with weights, 1 when the loss terms were divided ahead or each by its own count (see ``terms``).
        weighting: ``"unweighted"``, ``"weighted"``, ``"divided ahead"`` or ``"terms"`` (each loss term by its own
            count, ``terms=``; ``"none"``: no microbatch yet).
        weight_local: this rank's total weight (None without weights).
        weight_per_rank: each rank's total weight (None without weights or before finish).
        weight_global: the total weight over all ranks, the divisor of a weighted window.
        participation_local: parameter name -> microbatches in which it got a gradient, on this rank.
        participation_global: the same summed over ranks. Reported, never a divisor.
        terms_local: loss term -> this rank's count, as given to ``divisors()``, or to ``mb.backward()`` and
            ``count()`` with ``terms=`` (None if neither is used).
        terms: loss term -> its global divisor, what the user divided that term by (``divisors()``), or what
            ``finish()`` divided that term's summed gradient by (``terms=``: its count on all ranks; 0 for a term
            that counted nothing and whose gradient was zero or absent, which contributed nothing).
        rank_local: parameters kept rank-local, not reduced (DDP's ``parameters_to_ignore``): each rank's own sum.
        rank_local_divisor: what they were divided by, this rank's own count (None before finish, or where this
            rank counted nothing: their gradient is then None).
        span: which ranks (and device-mesh dims) the window was counted and reduced over: see :class:`Span`,
            and ``counted_over`` / ``reduced_over``.

    >>> Ledger(rank=0, world_size=1, microbatches_local=2, microbatches_global=2, microbatches_per_rank=(2,),
    ...        divisor=2, participation_local={"w": 1}, participation_global={"w": 1}).divisor
    2
    """

    rank: int
    world_size: int
    microbatches_local: int
    microbatches_global: int | None
    microbatches_per_rank: tuple[int, ...] | None
    divisor: float | None
    participation_local: dict[str, int]
    participation_global: dict[str, int] | None
    weighting: str = "unweighted"
    weight_local: float | None = None
    weight_per_rank: tuple[float, ...] | None = None
    weight_global: float | None = None
    terms_local: dict[str, float] | None = None
    terms: dict[str, float] | None = field(default=None)
    rank_local: tuple[str, ...] = ()
    rank_local_divisor: float | None = None
    span: Span = Span()
    _per: ClassVar[str] = "rank"  # what the ``*_per_rank`` fields are per, in the report (a pipeline's: "replica")

    @property
    def counted_over(self) -> tuple[str, ...]:
        """The mesh dims the divisor was counted over (``()`` without ``mesh=``: see ``span.ranks``)."""
        return self.span.counted_over

    @property
    def reduced_over(self) -> tuple[str, ...]:
        """The mesh dims FSDP2 reduced the sharded gradients over (``()``: gradagg reduced over ``counted_over``)."""
        return self.span.reduced_over

    def report(self) -> str:
        """A readable table of the window: M, the divisor and what it counted, participation per parameter.

        Returns:
            Several lines of text.
        """
        lines = [f"accumulation window, rank {self.rank} of {self.world_size}", self._counts_line()]
        lines += self._divisor_lines()
        lines += self.span.text()
        width = max([len("parameter")] + [len(n) for n in self.participation_local])
        lines.append(f"{'parameter':<{width}}  {'local':>6}  {'global':>6}")
        for name, local in self.participation_local.items():
            g = "-" if self.participation_global is None else str(self.participation_global[name])
            lines.append(f"{name:<{width}}  {local:>6}  {g:>6}")
        lines.append("participation = microbatches in which the parameter got a gradient; reported, never a divisor")
        if self.rank_local:
            d = "-" if self.rank_local_divisor is None else number_text(self.rank_local_divisor)
            lines.append(f"rank-local, not reduced (DDP's parameters_to_ignore), divided by this rank's own count {d}: "
                         f"{', '.join(self.rank_local)}")
        return "\n".join(lines)

    def _counts_line(self) -> str:
        per_rank = ""
        if self.microbatches_per_rank is not None:
            per_rank = f" (per {self._per}: {list(self.microbatches_per_rank)})"
        glob = "not finished" if self.microbatches_global is None else str(self.microbatches_global)
        return f"microbatches: local {self.microbatches_local}, global {glob}{per_rank}"

    def _divisor_lines(self) -> list[str]:
        if self.divisor is None:
            return ["divisor: not finished"]
        if self.weighting == "weighted":
            per_rank = ""
            if self.weight_per_rank is not None:
                per_rank = f" (per {self._per}: [{', '.join(number_text(w) for w in self.weight_per_rank)}])"
            return [f"divisor D = total weight = {number_text(self.divisor)}{per_rank}"]
        if self.weighting == "divided ahead":
            terms = ", ".join(f"{k} by {number_text(v)}" for k, v in (self.terms or {}).items())
            return [f"divisor D = 1: loss terms divided ahead ({terms})"]
        if self.weighting == "terms":
            terms = ", ".join(f"{k} by {number_text(v)}" for k, v in (self.terms or {}).items())
            return [f"each loss term divided by its count on all ranks: {terms}"]
        return [f"divisor M = {number_text(self.divisor)}"]


def number_text(x: float) -> str:
    """``x`` as a report writes it: ``44`` for 44.0, ``2.5`` for 2.5.

    >>> number_text(44.0), number_text(2.5)
    ('44', '2.5')
    """
    return str(int(x)) if float(x).is_integer() else repr(float(x))


__all__ = ["DIVIDED", "NONE", "TERMS", "UNWEIGHTED", "WEIGHTED", "WEIGHTING", "Ledger", "Span"]
