"""Judging one layout: every rank's gradients against the one-process truth, and what a miss looks like.

Relative error of a parameter p on a rank, with g its gradient there and t the truth's::

    error(p) = ||g - t|| / max(||t||, FLOOR * ||T||)

norms over all of p's entries (Frobenius), T the whole model's truth gradient. Per parameter, so a
small layer's miss is not drowned by a large one's; norm-based, so one entry near zero does not
blow up; the floor keeps a parameter whose true gradient is (near) zero from being judged by its
round-off alone. A layout passes when error(p) <= rtol for every parameter on every rank. Absent
(``grad is None``), zero and NaN stay apart: a gradient where the truth has none, none where it has
one, or a non-finite entry fails whatever the tolerance; so does one that could not be read
(:class:`Unread`: a DTensor whose shards do not make the whole).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gradagg.parity.layouts import format_layout
from gradagg.parity.types import Layout, Miss, Truth, Unread

if TYPE_CHECKING:
    import torch

    Grads = Mapping[str, "torch.Tensor | Unread | None"]

# Default tolerance by the lowest precision among the parameters. float64: two orders of summation
# differ by ~1e-15 relative (measured 7e-16 on the examples): 1e-9 leaves a margin of 10^6 and still
# tells a divisor off by one in 10^8. float32: measured up to 7e-5 (cross-entropy gradients cancel
# across tokens, which amplifies round-off): 1e-3 leaves a margin of 10; divisor mistakes on
# variable-length data miss by 1e-2 and more. Half precision: a few roundings of bf16's 2**-8 (measured on steps under
# CPU autocast, tests/parity/test_low_precision.py): 5e-2 leaves a margin of 10 for bf16 and is coarse for fp16;
# weighting mistakes on variable-length data still miss by tens of percent.
RTOL_BY_DTYPE = {"torch.float64": 1e-9, "torch.float32": 1e-3, "torch.float16": 5e-2, "torch.bfloat16": 5e-2}
_RTOL_OTHER = 1e-3


def default_rtol(truth: Truth) -> float:
    """The default ``--rtol`` for the truth's dtypes: the loosest of theirs (see ``RTOL_BY_DTYPE``)."""
    dtypes = {str(g.dtype) for g in truth.grads.values() if g is not None}
    return max(RTOL_BY_DTYPE.get(d, _RTOL_OTHER) for d in dtypes)


def compare_rank(rank: int, grads: Grads, truth: Truth) -> list[Miss]:
    """Every parameter of one rank against the truth."""
    misses = []
    for name, t in truth.grads.items():
        if name not in grads:
            misses.append(Miss(name, rank, math.inf, f"rank {rank}: the model has no parameter {name!r}"))
            continue
        error, problem = _param_error(name, grads[name], t, truth)
        misses.append(Miss(name, rank, error, None if problem is None else f"rank {rank}: {problem}"))
    return misses


def _param_error(name: str, g: torch.Tensor | Unread | None, t: torch.Tensor | None,
                 truth: Truth) -> tuple[float, str | None]:
    import torch

    if isinstance(g, Unread):
        return math.inf, g.why
    if g is None and t is None:
        return 0.0, None  # absent on both sides: agreed
    if t is None:
        what = "all zeros" if g is not None and not bool(g.any()) else f"norm {_norm(g):.3g}"
        return math.inf, f"{name!r} has a gradient ({what}) where the full batch has none: absent is not zero"
    if g is None:
        return math.inf, f"{name!r} has no gradient; the full batch's has norm {truth.norms[name]:.3g}"
    if g.shape != t.shape:
        return math.inf, (f"{name!r} has a gradient of shape {list(g.shape)}, the full batch's is {list(t.shape)} "
                          "(a shard, not gathered?)")
    bad = int((~torch.isfinite(g)).sum())
    if bad:
        return math.nan, f"{name!r} has {bad} non-finite entries (NaN or Inf) out of {g.numel()}"
    return _norm(g.double() - t.double()) / truth.scale(name), None


def _norm(t: torch.Tensor | None) -> float:
    return 0.0 if t is None else float(t.double().norm())


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() * b.double()).sum())


# --- the observation of one layout ------------------------------------------------------------


def judge(layout: Layout, truth: Truth, results: Mapping[int, Grads], failures: Mapping[int, str],
          rtol: float) -> dict[str, Any]:
    """The observation of one layout, in the ``gradagg verify`` form plus what locates the miss.

    Args:
        layout: microbatches per rank.
        truth: the one-process gradients.
        results: rank -> its gradients, for the ranks whose step returned.
        failures: rank -> what went wrong, for the others.
        rtol: the tolerance of the relative error.

    Returns:
        ``{"check", "actual", "expected", "passed", "layout", "parameter", "rank", "ratio", "diagnosis"}``.
    """
    check = f"layout {format_layout(layout)}: gradients match the one-process full batch"
    if failures:
        return _ordered(check, layout, rtol, _failed_ranks(layout, failures, sorted(results)))
    misses = [m for rank in sorted(results) for m in compare_rank(rank, results[rank], truth)]
    worst = max(misses, key=lambda m: m.key)
    passed = all(m.error <= rtol for m in misses)
    ratio, diagnosis = (None, "every rank matches the full batch on every parameter") if passed else \
        diagnose(layout, truth, results, misses, rtol)
    actual: Any = worst.problem if worst.problem is not None and not math.isnan(worst.error) else _json(worst.error)
    return _ordered(check, layout, rtol, {"actual": actual, "passed": passed, "parameter": worst.name,
                                          "rank": worst.rank, "ratio": ratio, "diagnosis": diagnosis})


def _ordered(check: str, layout: Layout, rtol: float, found: dict[str, Any]) -> dict[str, Any]:
    """The verify form's keys first, in its order, then where and why."""
    return {"check": check, "actual": found["actual"], "expected": f"<= {rtol:g}", "passed": found["passed"],
            "layout": list(layout), **{k: found[k] for k in ("parameter", "rank", "ratio", "diagnosis")}}


def _failed_ranks(layout: Layout, failures: Mapping[int, str], returned: list[int]) -> dict[str, Any]:
    # A rank that failed first-hand comes first; the ones that failed waiting for it in a collective after.
    ordered = sorted(failures, key=lambda r: (_secondary(failures[r]), r))
    first = ordered[0]
    why = f"rank {first}: {failures[first]}"
    if not all(_secondary(failures[r]) for r in ordered):
        why += f"; then rank {_ranks(ordered[1:])}, waiting for it" if len(ordered) > 1 else ""
    elif returned:  # no rank failed first-hand: the ones that returned left the others waiting
        why += (f" (rank {_ranks(returned)} returned from step() while rank {_ranks(ordered)} waited for it in a "
                "collective: does every rank run the same collectives, a rank with no microbatch included?)")
    elif len(layout) > 1:  # every rank failed waiting: for each other
        why = _collectives_differ(layout, why)
    return {"actual": "; ".join(f"rank {r}: {failures[r]}" for r in ordered), "passed": False, "parameter": None,
            "rank": first, "ratio": None, "diagnosis": why}


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _collectives_differ(layout: Layout, first: str) -> str:
    why = (f"every rank failed inside a collective, timed out or left by its peer ({first}): the ranks do not "
           "run the same collectives in the same order")
    if len(set(layout)) > 1:
        why += ("; this layout gives them different numbers of microbatches: is there a collective per microbatch "
                "(FSDP's all-gathers and reduce-scatters, DDP's all-reduce)?")
    return why


def _secondary(message: str) -> bool:
    """Whether a failure reads like the consequence of a peer's (a collective that timed out or lost its peer)."""
    text = message.lower()
    return any(s in text for s in ("gloo", "connection", "timed out", "timeout", "peer", "nccl"))


def _tensor(g: Any) -> bool:
    return g is not None and not isinstance(g, Unread)


def _json(x: float) -> Any:
    return x if math.isfinite(x) else repr(x)


# --- what a miss looks like -----------------------------------------------------------------


def diagnose(layout: Layout, truth: Truth, results: Mapping[int, Grads], misses: list[Miss],
             rtol: float) -> tuple[float | None, str]:
    """(the one factor between the step's gradients and the truth, if there is one; a sentence for a human)."""
    problem = _presence_problem(layout, results, misses)
    if problem is not None:
        return None, problem
    worst = max(m.error for m in misses)
    if worst <= truth.roundoff:  # before naming a cause: an error round-off alone reaches is no weighting's mark
        return None, _roundoff_text(worst, truth)
    disagreement = _disagreement(truth, results, rtol)
    if disagreement is not None:
        return None, disagreement
    worst_rank = max(misses, key=lambda m: m.key).rank
    return _scale(layout, truth, results[worst_rank], rtol)


def _presence_problem(layout: Layout, results: Mapping[int, Grads], misses: list[Miss]) -> str | None:
    for rank in sorted(results):
        if results[rank] and all(g is None for g in results[rank].values()):
            return (f"rank {rank}: step() left every gradient None: did it train the model it was given? "
                    "(prepare() must wrap the model, not copy it)")
    for m in sorted(misses, key=lambda m: (not math.isnan(m.error), m.rank)):
        if m.problem is not None:
            empty = math.isnan(m.error) and layout[m.rank] == 0
            return m.problem + (f" (rank {m.rank} ran no microbatch: a division by zero?)" if empty else "")
    return None


def _disagreement(truth: Truth, results: Mapping[int, Grads], rtol: float) -> str | None:
    ranks = sorted(results)
    for rank in ranks[1:]:
        gaps = [(_norm(g.double() - results[ranks[0]][n].double()) / truth.scale(n), n)  # type: ignore[union-attr]
                for n, g in results[rank].items() if _tensor(g) and _tensor(results[ranks[0]].get(n))]
        gap, name = max(gaps, default=(0.0, ""))
        if gap > rtol:
            return (f"ranks disagree: {name!r} on rank {rank} differs from rank {ranks[0]}'s by {gap:.2g} "
                    "(relative): are the gradients all-reduced across ranks?")
    return None


def _scale(layout: Layout, truth: Truth, grads: Grads, rtol: float) -> tuple[float | None, str]:
    """Project each significant parameter's gradient on its truth: one factor everywhere is a divisor's mark."""
    ratios, residuals = projections(truth, grads)
    if not ratios:
        return None, "no parameter has a gradient large enough to compare"
    lo, hi = min(ratios), max(ratios)
    ratio = (lo + hi) / 2
    if max(residuals) <= rtol and hi - lo <= 2 * rtol * max(abs(lo), abs(hi)) and \
            _explains_the_rest(truth, grads, ratio, rtol):
        return ratio, ratio_text(ratio, len(layout), sum(layout), rtol)
    return None, (f"no single factor: projected on the truth, the gradients are {lo:.3g}x to {hi:.3g}x it per "
                  "parameter and point elsewhere: the microbatches or ranks are weighted unlike the full batch "
                  "(a mean loss given weight=n, divided twice where weight= needs the summed loss? a mean of "
                  "per-microbatch or per-rank means?)")


def _explains_the_rest(truth: Truth, grads: Grads, ratio: float, rtol: float) -> bool:
    """Whether ``ratio`` also explains the parameters below the floor, which gave no ratio of their own: a miss
    on a small layer alone, the rest exact, is no common factor of 1."""
    for name, t in truth.grads.items():
        g = grads.get(name)
        if t is None or not _tensor(g) or truth.norms[name] >= truth.floor:
            continue
        if _norm(g.double() - ratio * t.double()) / truth.scale(name) > rtol * max(1.0, abs(ratio)):  # type: ignore[union-attr]
            return False
    return True


def projections(truth: Truth, grads: Grads) -> tuple[list[float], list[float]]:
    """Per significant parameter: its gradient's factor along its truth, and the relative residual off that line.

    Args:
        truth: the one-process gradients.
        grads: one rank's gradients.

    Returns:
        (factors, residuals), one of each per parameter whose truth is above the floor and whose gradient is a
        tensor (near-zero truths carry no reliable factor).
    """
    ratios, residuals = [], []
    for name, t in truth.grads.items():
        g = grads.get(name)
        if t is None or g is None or isinstance(g, Unread) or truth.norms[name] < truth.floor:
            continue
        r = _dot(g, t) / _dot(t, t)
        ratios.append(r)
        residuals.append(_norm(g.double() - r * t.double()) / truth.scale(name))
    return ratios, residuals


def _roundoff_text(error: float, truth: Truth) -> str:
    dtype = truth.computes_in.removeprefix("torch.")
    return (f"round-off, not a weighting mistake: the largest error, {error:.2g}, is within what {dtype} round-off "
            f"reaches (up to {truth.roundoff:g}: the full batch or the step computes in {dtype}, e.g. a loss that "
            f"casts the logits, or torch.autocast); a tolerance of {truth.roundoff:g} passes it")


def ratio_text(ratio: float, world: int, window: int, rtol: float = 1e-3) -> str:
    """The sentence for gradients that are ``ratio`` times the truth on every parameter.

    Args:
        ratio: the common factor.
        world: ranks in the layout.
        window: microbatches in the window (M).
        rtol: how close a factor must be to a count to be named after it.

    Returns:
        A sentence that names the likely divisor mistake.

    >>> ratio_text(0.5, 1, 8)
    'grads are 0.5x the truth on every parameter: a divisor twice too large?'
    """
    if abs(ratio) <= rtol:
        return "every gradient is zero: did step() leave zeros in .grad?"
    if ratio < 0:
        return f"grads are {ratio:.3g}x the truth on every parameter: a sign flipped?"
    head = f"grads are {ratio:.3g}x the truth on every parameter: "
    if ratio < 1:
        k = 1 / ratio
        return head + f"a divisor {_times(k, rtol)} too large" + (_hint(k, world, window, rtol, "large") or "?")
    hint = _hint(ratio, world, window, rtol, "small") or " (a division left out?)"
    return head + f"a divisor {_times(ratio, rtol)} too small" + hint


def _times(k: float, rtol: float) -> str:
    return "twice" if _near(k, 2, rtol) else f"{k:.3g} times"


def _hint(k: float, world: int, window: int, rtol: float, direction: str) -> str:
    if world > 1 and _near(k, world, rtol):
        what = "divided by the ranks on top of a global divisor" if direction == "large" else \
            "summed over the ranks where a mean belongs"
        return f" (the world size, {world}: {what}?)"
    if window > 1 and _near(k, window, rtol):
        return f" (the number of microbatches, {window}: divided by M, or not, where another divisor belongs?)"
    return ""


def _near(k: float, n: int, rtol: float) -> bool:
    return abs(k / n - 1) <= max(10 * rtol, 1e-9)
