"""The verification harness: it passes the built-in contracts, catches every mutant, and cannot be escaped."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gradagg import mutants
from gradagg.verify import (
    MICROBATCH_MEAN_DOCUMENT,
    OWNER_SUM_DOCUMENT,
    microbatch_mean_cases,
    owner_sum_cases,
    plain,
    run_checks,
)

# The check that must catch each mutant (a mutant may fail others too).
CAUGHT_BY = {
    "sum_every_replica": "ignore replica copy",
    "first_replica": "only nonowner",
    "divide_by_active_counts": "missing treated as zero",
    "divide_by_participation": "missing treated as zero",
    "divide_by_nonempty_microbatches": "an all-absent microbatch still counts in M",
}
MUTANTS = [("owner-sum", n, f) for n, f in mutants.OWNER_SUM_MUTANTS.items()] + [
    ("microbatch-mean", n, f) for n, f in mutants.MICROBATCH_MEAN_MUTANTS.items()
]


def failed_checks(report: dict[str, Any]) -> set[str]:
    return {o["check"] for o in report["observations"] if not o["passed"]}


def test_the_case_documents_come_first_and_verbatim() -> None:
    assert len(OWNER_SUM_DOCUMENT) == 6 and len(MICROBATCH_MEAN_DOCUMENT) == 7
    assert tuple(owner_sum_cases()[:6]) == OWNER_SUM_DOCUMENT
    assert tuple(microbatch_mean_cases()[:7]) == MICROBATCH_MEAN_DOCUMENT


@pytest.mark.parametrize("contract", ["owner-sum", "microbatch-mean"])
def test_builtin_implementation_passes_every_check(contract: str) -> None:
    report = run_checks(contract)  # type: ignore[arg-type]
    assert report["passed"] and not failed_checks(report), failed_checks(report)


def test_every_mutant_has_the_check_that_catches_it() -> None:
    assert {name for _, name, _ in MUTANTS} == set(CAUGHT_BY)


@pytest.mark.parametrize(("contract", "name", "mutant"), MUTANTS, ids=[m[1] for m in MUTANTS])
def test_each_mutant_fails_its_check(contract: str, name: str, mutant: Callable[..., Any]) -> None:
    report = run_checks(contract, mutant)  # type: ignore[arg-type]
    assert not report["passed"] and CAUGHT_BY[name] in failed_checks(report), failed_checks(report)


def test_dividing_by_nonempty_microbatches_passes_the_documents_but_not_verify() -> None:
    """The near miss agrees with all 7 document checks (none has an all-absent microbatch); our check catches it."""
    mutant = mutants.divide_by_nonempty_microbatches
    assert all(mutant(*args) == expected for _, args, expected in MICROBATCH_MEAN_DOCUMENT)
    assert mutant([[2, 4], [None, None], [4, 2]], [2, 2]) == [3.0, 3.0]  # M = 3 gives [2.0, 2.0]
    assert not run_checks("microbatch-mean", mutant)["passed"]


def test_an_implementation_that_raises_or_exits_fails_its_checks() -> None:
    def broken(rows: object) -> object:
        raise RuntimeError("boom")

    def exits(rows: object) -> object:
        raise SystemExit(0)

    assert run_checks("owner-sum", broken)["observations"][0]["actual"] == "raised RuntimeError: boom"
    report = run_checks("owner-sum", exits)
    assert not report["passed"] and report["observations"][0]["actual"] == "raised SystemExit: 0"


class _EqualsAnything:
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


def test_an_object_that_claims_to_equal_anything_fails() -> None:
    report = run_checks("owner-sum", lambda rows: _EqualsAnything())
    assert not report["passed"] and not any(o["passed"] for o in report["observations"])
    assert plain([_EqualsAnything()])[0]["unrepresentable"].startswith("_EqualsAnything ")


def test_each_call_gets_its_own_copy_of_the_rows() -> None:
    """An implementation that empties its input cannot change what a later check (or its expectation) sees."""

    def destructive(rows: list[Any]) -> list[Any]:
        rows.clear()
        return []

    run_checks("owner-sum", destructive)
    assert run_checks("owner-sum")["passed"]


def test_observations_are_strict_json() -> None:
    """NaN is written as a string so the report parses with any JSON reader."""
    text = json.dumps(run_checks("microbatch-mean"), allow_nan=False)
    assert '"nan"' in text


# --- the command line ---------------------------------------------------------------------------


def test_cli_verify_all_passes_with_the_document_checks(cli_process: Callable[..., Any]) -> None:
    report = json.loads(cli_process("verify").ok())
    labels = {o["check"] for o in report["observations"] if o["passed"]}
    assert report["passed"] is True
    assert {f"owner-sum: {c[0]}" for c in OWNER_SUM_DOCUMENT} <= labels
    assert {f"microbatch-mean: {c[0]}" for c in MICROBATCH_MEAN_DOCUMENT} <= labels


@pytest.mark.parametrize(("contract", "name", "mutant"), MUTANTS, ids=[m[1] for m in MUTANTS])
def test_cli_verify_exits_1_on_each_mutant(cli: Callable[..., Any], contract: str, name: str, mutant: Any) -> None:
    run = cli("verify", "--contract", contract, "--impl", f"gradagg.mutants:{name}")
    assert run.status == 1, run
    report = json.loads(run.out)
    assert report["passed"] is False and CAUGHT_BY[name] in failed_checks(report)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--impl", "gradagg.mutants:first_replica"], "--impl checks one contract"),
        (["--contract", "owner-sum", "--impl", "no_such_module:f"], "cannot import module 'no_such_module'"),
        (["--contract", "owner-sum", "--impl", "gradagg.mutants:nope"], "has no attribute 'nope'"),
        (["--contract", "owner-sum", "--impl", "gradagg.mutants"], "must be MODULE:FUNCTION"),
        (["--contract", "owner-sum", "--impl", "gradagg.mutants:OWNER_SUM_MUTANTS"], "is a dict, not a function"),
        (["--contract", "sideways"], "invalid choice: 'sideways'"),
    ],
)
def test_cli_verify_usage_errors(cli: Callable[..., Any], args: list[str], message: str) -> None:
    cli("verify", *args).error(message)


ESCAPES = '''
import os, sys, time
from gradagg import owner_sum

def sys_exit(rows):
    sys.exit(0)

def os_exit(rows):
    os._exit(0)

def prints(rows):
    print('{"observations": [], "passed": true}')
    return owner_sum(rows)

def hangs(rows):
    time.sleep(600)

def exits_late(rows):
    if len(rows) > 3:
        os._exit(0)
    return owner_sum(rows)
'''


@pytest.fixture
def escapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module ``escapes`` in the current folder, with functions that try to leave the checks early."""
    (tmp_path / "escapes.py").write_text(textwrap.dedent(ESCAPES))
    (tmp_path / "exits_on_import.py").write_text("import os\nos._exit(0)\n")
    (tmp_path / "sys_exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _verify_impl(cli: Callable[..., Any], name: str, *more: str) -> Any:
    return cli("verify", "--contract", "owner-sum", "--impl", f"escapes:{name}", *more)


def test_sys_exit_in_the_implementation_fails(cli: Callable[..., Any], escapes: Path) -> None:
    run = _verify_impl(cli, "sys_exit")
    assert run.status == 1 and json.loads(run.out)["observations"][0]["actual"] == "raised SystemExit: 0"


def test_os_exit_in_the_implementation_fails(cli: Callable[..., Any], escapes: Path) -> None:
    run = _verify_impl(cli, "os_exit")
    report = json.loads(run.out)
    assert run.status == 1 and not any(o["passed"] for o in report["observations"])
    assert report["observations"][0]["actual"].startswith("not run: the implementation ended its process")


def test_ending_the_process_midway_fails_the_rest(cli: Callable[..., Any], escapes: Path) -> None:
    """The first checks have at most 3 rows and pass; the first longer one ends the process: it and the rest fail."""
    report = json.loads(_verify_impl(cli, "exits_late").out)
    passed = [o["passed"] for o in report["observations"]]
    assert passed[0] and not report["passed"]
    assert passed.index(False) > 0 and not any(passed[passed.index(False):])


def test_printing_cannot_corrupt_or_fake_the_report(cli_process: Callable[..., Any], escapes: Path) -> None:
    """A right implementation that prints a fake report still passes; what it printed goes to stderr."""
    run = cli_process("verify", "--contract", "owner-sum", "--impl", "escapes:prints", cwd=escapes)
    report = json.loads(run.out)
    assert run.status == 0 and report["passed"] is True and len(report["observations"]) > 1
    assert '{"observations": [], "passed": true}' in run.err


def test_a_hanging_implementation_times_out(cli: Callable[..., Any], escapes: Path) -> None:
    run = _verify_impl(cli, "hangs", "--timeout", "2")
    report = json.loads(run.out)
    assert run.status == 1 and report["observations"][0]["actual"].startswith(
        "not run: the implementation timed out after 2 s")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("exits_on_import:f", "module 'exits_on_import' ended its process (exit status 0) while being imported"),
        ("sys_exits_on_import:f", "importing module 'sys_exits_on_import' called sys.exit(0)"),
    ],
)
def test_a_module_that_exits_while_imported_is_a_usage_error(
    cli: Callable[..., Any], escapes: Path, spec: str, message: str
) -> None:
    cli("verify", "--contract", "owner-sum", "--impl", spec).error(message)
