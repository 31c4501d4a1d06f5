"""How a microbatch counts: its weight taken when given, read once, checked, summed exactly.

The rules that every accumulator of gradagg shares, the window's (:class:`~gradagg.torch.MicrobatchAccumulator`)
and the pipeline's (:class:`~gradagg.torch.PipelineAccumulator`, whose last stage takes the count of each
microbatch from the loss): a **weight** (a count) is what a microbatch counts for in the divisor D, typically its
number of valid tokens.

- :func:`check_weight` takes a weight's value when it is given: a number, or a copy of a 0-dim tensor on its
  device (no host sync), so that a tensor the caller reuses counts the value it held then;
- :func:`weight_values` reads the kept weights in one transfer;
- :func:`weight_problem` names the first weight that cannot count (negative, NaN, infinite, on the meta device)
  by its microbatch, or a sum beyond float64; the same words wherever it is refused;
- :func:`weight_sum` sums them exactly (``math.fsum``), rounded once, never raising;
- :func:`divisor_problem` says whether sums in a dtype can be divided by that sum.

:class:`Tally` holds one rank's weights in microbatch order and reads them once into a :class:`Read`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import cast

import torch

from gradagg.errors import GradaggError
from gradagg.torch.placements import dtype_name, is_dtensor

Weight = float | torch.Tensor
"""A weight as kept: a float, or a 0-dim tensor copied when given (read later, in one transfer)."""


def check_weight(weight: object) -> Weight:
    """A microbatch weight, its value taken now: a real number, or a copy of a 0-dim real tensor.

    A tensor is copied on its device (no host sync): a count the caller keeps in one tensor and updates in place
    for the next microbatch (``w.copy_(n)``) still counts the value it had here. A DTensor counts its global value
    when every rank holds it whole (``Replicate`` placements: its local tensor); a ``Partial`` one has no value here
    without a collective that ranks with other microbatch counts would not all run, and is refused.

    A value that cannot count (negative, NaN, infinite, beyond float64, a tensor on the meta device, which has
    no value) is not refused here: :func:`weight_problem` names it and ``finish()`` refuses on every rank.

    Raises:
        GradaggError: a bool, a string, a complex number, a tensor with more than one element, a DTensor that is
            not replicated, ...

    >>> check_weight(12)
    12.0
    >>> count = torch.tensor(3)
    >>> taken = check_weight(count); _ = count.fill_(5); int(taken)
    3
    >>> check_weight(True)
    Traceback (most recent call last):
    ...
    gradagg.errors.GradaggError: a microbatch weight must be a real number or a 0-dim tensor, got bool True
    """
    if isinstance(weight, torch.Tensor):
        if weight.dim() != 0 or weight.dtype == torch.bool or weight.is_complex():
            raise GradaggError(
                f"a microbatch weight tensor must be 0-dim and real, got shape {tuple(weight.shape)} {weight.dtype}"
            )
        return _local_value(weight).detach().clone()
    if isinstance(weight, bool) or not isinstance(weight, Real):
        raise GradaggError(
            f"a microbatch weight must be a real number or a 0-dim tensor, got {type(weight).__name__} {weight!r}"
        )
    try:
        return float(weight)
    except OverflowError:  # an int (or Fraction) beyond float64: refused on every rank by weight_problem
        return math.inf if cast(float, weight) > 0 else -math.inf


def _local_value(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding ``weight``'s global value: a replicated DTensor's local copy (``to_local()``, public)."""
    if not is_dtensor(weight):
        return weight
    placements = tuple(weight.placements)  # type: ignore[attr-defined]
    if not all(p.is_replicate() for p in placements):
        raise GradaggError(
            f"a microbatch weight is a DTensor with placements {placements}: only a replicated one holds its global "
            "value on every rank; pass a plain tensor or number (e.g. weight.full_tensor(), called on every rank at "
            "the same point), or a DTensor with Replicate() placements"
        )
    return cast(torch.Tensor, weight.to_local())  # type: ignore[attr-defined]


def weight_values(weights: list[Weight]) -> list[float]:
    """The weights as Python floats (tensors read in one transfer; one on the meta device reads as NaN).

    >>> weight_values([2.0, torch.tensor(3, dtype=torch.int8), torch.tensor(1.0, device="meta")])
    [2.0, 3.0, nan]
    """
    tensors = [w for w in weights if isinstance(w, torch.Tensor) and not w.is_meta]
    read = iter(torch.stack([t.double().cpu() for t in tensors]).tolist() if tensors else [])
    return [(math.nan if w.is_meta else next(read)) if isinstance(w, torch.Tensor) else w for w in weights]


def weight_problem(weights: list[Weight], values: list[float]) -> str | None:
    """The first weight that cannot count, named by its microbatch; or a sum of weights beyond float64.

    >>> weight_problem([1.0, -2.0], [1.0, -2.0])
    'microbatch 1 has weight -2.0: a weight must be finite and non-negative'
    """
    for k, (w, v) in enumerate(zip(weights, values)):
        if isinstance(w, torch.Tensor) and w.is_meta:
            return f"microbatch {k} has a weight tensor on the meta device, which holds no value to count"
        if not math.isfinite(v) or v < 0:
            return f"microbatch {k} has weight {v}: a weight must be finite and non-negative"
    if not math.isfinite(weight_sum(values)):
        return f"the {len(values)} weights of this rank's window sum beyond float64 (more than {_FLOAT64_MAX:.3e})"
    return None


_FLOAT64_MAX = 1.7976931348623157e308


def weight_sum(values: list[float]) -> float:
    """The exact sum of ``values`` rounded once (``math.fsum``), never an exception: infinite where it leaves
    float64, NaN for ``inf + -inf`` (such weights were already named by :func:`weight_problem`).

    >>> weight_sum([1e308, 1e308]), weight_sum([math.inf, -math.inf])
    (inf, nan)
    """
    try:
        return math.fsum(values)
    except OverflowError:  # the exact sum of finite values leaves float64
        return math.inf
    except ValueError:  # fsum refuses inf + -inf
        return math.nan


def divisor_problem(divisor: float, dtype: torch.dtype) -> str | None:
    """Why sums held in ``dtype`` cannot be divided by ``divisor`` (the end of a sentence that names it), or None.

    torch divides a ``dtype`` tensor by a Python number in ``dtype``: a divisor beyond its range divides every
    gradient to 0 (or NaN), one below its smallest normal to infinity, silently. D = 0 is the caller's to name.

    >>> divisor_problem(1e39, torch.float32)
    'is beyond what float32 sums can be divided by'
    >>> divisor_problem(1e39, torch.float64) is None
    True
    """
    finfo = torch.finfo(dtype)
    if not divisor <= finfo.max:
        return f"is beyond what {dtype_name(dtype)} sums can be divided by"
    if divisor < finfo.tiny:
        return f"is below the smallest normal {dtype_name(dtype)}"
    return None


@dataclass(frozen=True)
class Read:
    """One rank's weights as read once: their values in microbatch order, why they cannot count, and their sum.

    Attributes:
        values: each microbatch's weight, a Python float.
        problem: :func:`weight_problem`'s text (None: every weight counts).
        total: :func:`weight_sum` of ``values``: exact, rounded once; meaningful only when ``problem`` is None.
    """

    values: tuple[float, ...]
    problem: str | None
    total: float


@dataclass
class Tally:
    """One rank's microbatch weights, in the order their microbatches ran, each taken when given.

    >>> tally = Tally()
    >>> count = torch.tensor(6)
    >>> _ = tally.add(count); _ = count.fill_(4); _ = tally.add(count); _ = tally.add(float("nan"))
    >>> read = tally.read(); read.values, read.total
    ((6.0, 4.0, nan), nan)
    >>> read.problem
    'microbatch 2 has weight nan: a weight must be finite and non-negative'
    """

    weights: list[Weight] = field(default_factory=list)

    def add(self, weight: object) -> Weight:
        """Take one microbatch's weight now (:func:`check_weight`) and keep it.

        Returns:
            The weight as kept.

        Raises:
            GradaggError: as :func:`check_weight` (a weight that is not one real number).
        """
        value = check_weight(weight)
        self.weights.append(value)
        return value

    def read(self) -> Read:
        """The weights' values (one device read, none when no weight is a tensor), their problem and their sum."""
        values = weight_values(self.weights)
        return Read(tuple(values), weight_problem(self.weights, values), weight_sum(values))


__all__ = [
    "Read", "Tally", "Weight", "check_weight", "divisor_problem", "weight_problem", "weight_sum", "weight_values",
]
