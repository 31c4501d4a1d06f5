"""The verification harness: it passes the built-in contracts and catches every mutant."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradagg import mutants
from gradagg.verify import microbatch_mean_cases, owner_sum_cases, run_checks

DOCUMENT_OWNER_SUM = {
    "ignore replica copy",
    "empty owners",
    "only nonowner",
    "owner can be late",
    "several owners",
    "owner contributions add",
}
DOCUMENT_MEAN = {
    "missing treated as zero",
    "all present",
    "single missing",
    "empty rows",
    "zero active count",
    "late participation",
    "zero gradient",
}


def test_every_document_check_is_included() -> None:
    assert DOCUMENT_OWNER_SUM <= {label for label, _, _ in owner_sum_cases()}
    assert DOCUMENT_MEAN <= {label for label, _, _ in microbatch_mean_cases()}


@pytest.mark.parametrize("contract", ["owner-sum", "microbatch-mean"])
def test_builtin_implementation_passes_every_check(contract: str) -> None:
    result = run_checks(contract)  # type: ignore[arg-type]
    failed = [o for o in result["observations"] if not o["passed"]]
    assert result["passed"] and not failed, failed


@pytest.mark.parametrize("name", sorted(mutants.OWNER_SUM_MUTANTS))
def test_owner_sum_mutants_are_caught(name: str) -> None:
    result = run_checks("owner-sum", mutants.OWNER_SUM_MUTANTS[name])
    assert not result["passed"]
    failed = {o["check"] for o in result["observations"] if not o["passed"]}
    assert failed & DOCUMENT_OWNER_SUM, "a mutant must fail at least one of the case documents' checks"


@pytest.mark.parametrize("name", sorted(mutants.MICROBATCH_MEAN_MUTANTS))
def test_microbatch_mean_mutants_are_caught(name: str) -> None:
    result = run_checks("microbatch-mean", mutants.MICROBATCH_MEAN_MUTANTS[name])
    assert not result["passed"]
    assert any(not o["passed"] for o in result["observations"] if o["check"] in DOCUMENT_MEAN)


def test_an_implementation_that_raises_fails_its_checks_without_crashing() -> None:
    def broken(rows: object) -> object:
        raise RuntimeError("boom")

    result = run_checks("owner-sum", broken)
    assert not result["passed"]
    assert result["observations"][0]["actual"] == "raised RuntimeError: boom"


def test_observations_are_strict_json() -> None:
    """NaN is written as a string so the report parses with any JSON reader."""
    text = json.dumps(run_checks("microbatch-mean"), allow_nan=False)
    assert '"nan"' in text


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gradagg", "verify", *args], capture_output=True, text=True)


def test_cli_verify_all_passes_with_at_least_13_observations() -> None:
    proc = _verify()
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] is True
    assert sum(o["passed"] for o in report["observations"]) >= 13


@pytest.mark.parametrize(
    ("contract", "name"),
    [("owner-sum", n) for n in mutants.OWNER_SUM_MUTANTS]
    + [("microbatch-mean", n) for n in mutants.MICROBATCH_MEAN_MUTANTS],
)
def test_cli_verify_exits_1_on_each_mutant(contract: str, name: str) -> None:
    proc = _verify("--contract", contract, "--impl", f"gradagg.mutants:{name}")
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["passed"] is False


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--impl", "gradagg.mutants:first_replica"], "--impl checks one contract"),
        (["--contract", "owner-sum", "--impl", "no_such_module:f"], "cannot import module 'no_such_module'"),
        (["--contract", "owner-sum", "--impl", "gradagg.mutants:nope"], "has no attribute 'nope'"),
        (["--contract", "owner-sum", "--impl", "gradagg.mutants"], "must be MODULE:FUNCTION"),
        (["--contract", "sideways"], "invalid choice: 'sideways'"),
    ],
)
def test_cli_verify_usage_errors(args: list[str], message: str) -> None:
    proc = _verify(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("gradagg: error:")
    assert message in proc.stderr and "Traceback" not in proc.stderr
