"""bench/MUTATION.md's tables from mutmut's last run (``make mutate``).

``python -m tests.mutation.report [SECONDS [NOTE]]``.

NOTE, where given, is a paragraph put under the header: what the run was, where it was not one ``make mutate``
(e.g. survivors run again with tests written after it).

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


def report(seconds: float | None, note: str | None = None) -> str:
    """The markdown of the last run: a table per module, then every survivor with its diff and reason."""
    from mutmut.configuration import config

    config()  # mutmut reads pyproject.toml's [tool.mutmut] from the working folder
    reasons = tomllib.loads(REASONS.read_text()) if REASONS.exists() else {}
    results = _results()
    import datetime
    import importlib.metadata
    import os

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    took = "" if seconds is None else f", {seconds / 60:.0f} minutes"
    lines = [
        "# Mutation testing of the counting rules",
        "",
        f"The last `make mutate` (mutmut {importlib.metadata.version('mutmut')}, {os.cpu_count()} cores{took}, "
        f"{when}); written by `tests/mutation/report.py`. What is mutated and which tests run: `[tool.mutmut]` in",
        "`pyproject.toml`. mutmut changes one expression at a time (an operator, a constant, an argument, a call",
        "dropped) and runs, for each mutant, the one-process tests that reach its function: *killed* is a test",
        "that failed; *survived*, none did; *no tests*, no one-process test reaches the function (only the gloo",
        "worlds do, which this run does not start: the fixed sample in `tests/mutation/test_sample.py` applies",
        "mutants there too); *other* is a mutant not run (a run stopped early) or one mutmut could not judge. Lines",
        "that only say what a message says are not mutated. A survivor's reason is in",
        "`tests/mutation/reasons.toml`: *equivalent* (no test can tell it apart), *one process* (it differs only",
        "with other ranks or another wrapper than this process has), *message* (it changes only a message's text).",
        "",
        *([note, ""] if note else []),
        "| module | mutants | killed | survived | no tests | timeout | other | killed / (killed + survived) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    total: Counter[str] = Counter()
    for path, mutants in results.items():
        counts = Counter(mutants.values())
        total.update(counts)
        lines.append(_row(path.removeprefix("src/gradagg/"), counts))
    lines.append(_row("**all**", total))
    survivors = [(path, name) for path, mutants in results.items() for name, s in mutants.items() if s == "survived"]
    kinds = Counter(reasons[n].split(":")[0] if n in reasons else "unexplained" for _, n in survivors)
    lines += ["", f"## Survivors: {len(survivors)} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})", ""]
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
    args = sys.argv[1:]
    sys.stdout.write(report(float(args[0]) if args else None, args[1] if len(args) > 1 else None))
