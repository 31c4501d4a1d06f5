"""The demo's printed output: per case a header, the ledger, the per-step errors and the summary (no torch)."""

from __future__ import annotations

from gradagg.demo import results
from gradagg.demo.options import WRAP_NAMES
from gradagg.demo.results import GRADAGG, CaseResult, Outcome, StepRecord


def print_outcome(outcome: Outcome, counts: tuple[int, ...], seed: int, steps: int, *, quiet: bool, where: str) -> None:
    """Print every case of ``outcome``, then the overall verdict.

    Args:
        outcome: rank 0's outcome.
        counts: microbatches per rank.
        seed: the seed.
        steps: the steps.
        quiet: summaries only (no ledger, no per-step table).
        where: where the world ran, for the first line.
    """
    print(f"gradagg demo: {outcome.world_size} gloo processes on {where}; microbatches per rank {list(counts)}, "
          f"M = {sum(counts)}; float64; seed {seed}; {steps} steps\ngradagg's model: {WRAP_NAMES[outcome.wrap]}")
    for case in outcome.cases:
        print_case(case, quiet=quiet)
    ok = results.passed(outcome)
    print("\ngradagg " + ("matched" if ok else "DID NOT match") + f" the full-batch gradient within "
          f"{results.TOLERANCE:.0e} " + ("at every step of every case" if ok else "at some step"))


def print_case(case: CaseResult, *, quiet: bool) -> None:
    """One case: what it is, gradagg's ledger and the per-step errors (unless ``quiet``), the summary."""
    print(f"\n== case {case.case}: {case.title}")
    for line in case.details:
        print(line)
    if not quiet:
        note = " (head_b is not in it: it goes through owner_reduce)" if case.case == "moe" else ""
        print(f"\ngradagg's ledger after step 0 (rank 0){note}")
        print(case.ledger)
        print_steps(case)
    print_summary(case)


def print_steps(case: CaseResult) -> None:
    """The max error of every approach at every step."""
    print("\nmax |gradient - ground truth| over all parameters and ranks (each approach trains its own copy)")
    print(f"{'step':>4}  {'loss':>8}  " + "  ".join(f"{a.short:>11}" for a in case.approaches))
    for r in case.records:
        errors = "  ".join(f"{r.error[a.name]:>11.1e}" for a in case.approaches)
        print(f"{r.step:>4}  {fit(r.loss[GRADAGG], 8)}  {errors}")
    print("(loss: gradagg's held-out loss before the step)")


def print_summary(case: CaseResult) -> None:
    """Per approach: its largest error, the verdict, its final loss, the parameters it got wrong; then why."""
    scale = max(r.scale for r in case.records)
    print(f"\nsummary over {len(case.records)} steps; tolerance {results.TOLERANCE:.0e}: in float64, sums added in "
          f"another order differ\nby a few ulps per term, and gradagg's gradient entries are |g| <= {scale:.2g} here")
    width = max(len(a.name) for a in case.approaches)
    print(f"{'approach':<{width}}  {'max error':>9}  {'verdict':<7}  {'final loss':>10}  parameters off (at any step)")
    for a in case.approaches:
        error = case.max_error(a.name)
        verdict = "exact" if error <= results.TOLERANCE else "WRONG"
        print(f"{a.name:<{width}}  {error:>9.1e}  {verdict:<7}  {fit(case.final_loss[a.name], 10)}  "
              f"{off_parameters(case.records, a.name)}")
    print("why:")
    for a in case.approaches:
        print(f"  {a.name:<{width}}  {a.why}")
    if case.case == "moe":
        print("(step 0 has no stale head_b replica yet, so the two replica mistakes happen to be right there)")


def fit(x: float, width: int) -> str:
    """``x`` right-aligned in ``width`` characters: 5 decimals when they fit, else in exponent form.

    A diverging approach's loss (1e16, inf, nan) must not push the table's columns apart.

    >>> fit(0.123456, 10), fit(1.05e16, 10), fit(float("inf"), 8), fit(-2.5e-9, 8)
    ('   0.12346', ' 1.050e+16', '     inf', '-2.5e-09')
    """
    fixed = f"{x:>{width}.5f}"
    if len(fixed) <= width and (x == 0 or abs(x) >= 1e-4 or x != x):
        return fixed
    for digits in range(max(0, width - 7), -1, -1):  # "d.ddde+XX": 6 characters besides the digits, 7 with "-"
        text = f"{x:>{width}.{digits}e}"
        if len(text) <= width:
            return text
    return f"{x:.0e}"


def off_parameters(records: list[StepRecord], name: str) -> str:
    """The parameters approach ``name`` got wrong at any step, grouped: ``experts 0,2; head_b``, or ``none``.

    >>> off_parameters([StepRecord(0, off={"a": ["experts.2.bias", "head_b", "experts.0.weight"]})], "a")
    'experts 0,2; head_b'
    """
    return group_names(sorted({n for r in records for n in r.off[name]})) or "none"


def group_names(names: list[str]) -> str:
    """``['blocks.0.linear.bias', 'blocks.1.linear.weight', 'head.bias']`` -> ``'blocks 0,1; head'``.

    >>> group_names(["blocks.0.linear.bias", "blocks.1.linear.weight", "embed.weight", "head.bias"])
    'blocks 0,1; embed; head'
    """
    groups: dict[str, set[str]] = {}
    for name in names:
        parts = name.split(".")
        index = {parts[1]} if len(parts) > 1 and parts[1].isdigit() else set()
        groups.setdefault(parts[0], set()).update(index)
    return "; ".join(f"{g} {','.join(sorted(idx, key=int))}" if idx else g for g, idx in sorted(groups.items()))
