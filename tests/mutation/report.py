"""bench/MUTATION.md's tables from mutmut's last run (``make mutate``): ``python -m tests.mutation.report [SECONDS]``.

Reads the results mutmut keeps under ``mutants/`` (one ``.meta`` file per mutated source file) and each surviving
mutant's diff, through mutmut's own functions (``mutmut==3.8.*``, pinned in requirements-dev.txt: they are not a
documented API). A survivor's reason, where one is known, is in ``tests/mutation/reasons.toml``: an equivalent
mutant says why no test can tell it apart; any other is listed as unexplained.
"""

from __future__ import annotations

import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

REASONS = Path(__file__).with_name("reasons.toml")
SHOWN = ("killed", "survived", "no tests", "timeout")


def _results() -> dict[str, dict[str, str]]:
    """Each mutated source file's mutants and their status, from mutants/."""
    from mutmut.stats import status_by_exit_code

    out = {}
    for meta in sorted(Path("mutants").glob("src/**/*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        out[str(meta.relative_to("mutants"))[: -len(".meta")]] = {k: status_by_exit_code[v] for k, v in codes.items()}
    return out


def _diff(name: str, path: str) -> list[str]:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    lines = get_diff_for_mutant(name, path=path).splitlines()
    return [line for line in lines if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def report(seconds: float | None) -> str:
    """The markdown of the last run: a table per module, then every survivor with its diff and reason."""
    from mutmut.configuration import config

    config()  # mutmut reads pyproject.toml's [tool.mutmut] from the working folder
    reasons = tomllib.loads(REASONS.read_text()) if REASONS.exists() else {}
    results = _results()
    lines = ["| module | mutants | killed | survived | no tests | timeout | other | killed / (killed + survived) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    total: Counter[str] = Counter()
    for path, mutants in results.items():
        counts = Counter(mutants.values())
        total.update(counts)
        lines.append(_row(path.removeprefix("src/gradagg/"), counts))
    lines.append(_row("**all**", total))
    if seconds is not None:
        lines += ["", f"The run took {seconds / 60:.0f} minutes."]
    survivors = [(path, name) for path, mutants in results.items() for name, s in mutants.items() if s == "survived"]
    unexplained = [n for _, n in survivors if n not in reasons]
    lines += ["", f"## Survivors: {len(survivors)}, unexplained: {len(unexplained)}", ""]
    for path, name in survivors:
        lines.append(f"- `{name}` ({reasons.get(name, 'UNEXPLAINED')})")
        lines += [f"  `{d.strip()[:150]}`" for d in _diff(name, path)]
    return "\n".join(lines) + "\n"


def _row(name: str, counts: Counter[str]) -> str:
    other = sum(v for k, v in counts.items() if k not in SHOWN)
    killed, survived = counts["killed"], counts["survived"]
    score = f"{killed / (killed + survived):.0%}" if killed + survived else "-"
    cells = [name, str(sum(counts.values())), *(str(counts[k]) for k in SHOWN), str(other), score]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    sys.stdout.write(report(float(sys.argv[1]) if len(sys.argv) > 1 else None))
