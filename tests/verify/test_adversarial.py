"""``gradagg verify --impl`` against implementations that attack the checker itself, not the contract.

Each module below wraps a known wrong fix (a mutant) and tries to make the checker believe it right:
by replacing the checker's own functions at import, by writing the expected answers where the
checker reads its answers, by writing them into every file descriptor it holds. The judging
happens in the parent process, against expected values the child never receives, on fresh twins of
every check drawn for the run: each attack must fail, and the mutant's own failures must show.
"""

from __future__ import annotations

import json
import random
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradagg import mutants
from gradagg.errors import GradaggError
from gradagg.reference import microbatch_mean, owner_sum
from gradagg.verify import cases, fresh_cases, observations, run_checks, run_checks_isolated
from tests.processes import gone

# Looks an answer up in the checker's own, public, case list: what a forger has without computing anything.
_LOOKUP = '''
import json
import gradagg.verify as verify

def expected_for(contract, args):
    wanted = json.dumps(list(args))
    for _, a, e in verify.cases(contract):
        if json.dumps(list(a)) == wanted:
            return e
    raise LookupError("not a case I know")
'''

ATTACKS = {
    # replaces gradagg.verify.call: the sum-every-replica mutant's calls answered from the case list
    "patches_call": '''
        import gradagg.verify as verify
        from gradagg.mutants import sum_every_replica as f
        from _lookup import expected_for
        _real = verify.call

        def _call(impl, args):
            try:
                return True, expected_for("owner-sum", args)
            except LookupError:
                return _real(impl, args)

        verify.call = _call
    ''',
    # replaces gradagg.verify.call with one that runs the reference instead of the function under test
    "patches_call_to_reference": '''
        import gradagg.verify as verify
        from gradagg.reference import owner_sum
        from gradagg.mutants import sum_every_replica as f
        _real = verify.call
        verify.call = lambda impl, args: _real(owner_sum if impl is f else impl, args)
    ''',
    # writes every expected answer into the file the checker reads (sys.argv[-1] in the old protocol), then ends
    "writes_answer_file": '''
        import json, os, sys
        from gradagg.verify import cases, plain
        from gradagg.mutants import sum_every_replica as f
        try:
            with open(sys.argv[-1], "w") as out:
                out.write(json.dumps({"imported": True}) + "\\n")
                for k, (_, _, e) in enumerate(cases("owner-sum")):
                    out.write(json.dumps({"case": k, "ok": True, "value": plain(e)}) + "\\n")
        except OSError:
            pass
        os._exit(0)
    ''',
    # writes the expected answers into every descriptor it holds (a pipe the parent reads among them)
    "writes_every_fd": '''
        import json, os
        from gradagg.verify import cases, plain
        from gradagg.mutants import sum_every_replica as f
        lines = json.dumps({"imported": True}) + "\\n" + "".join(
            json.dumps({"case": k, "ok": True, "value": plain(e)}) + "\\n"
            for k, (_, _, e) in enumerate(cases("owner-sum")))
        for fd in range(3, 64):
            try:
                os.write(fd, lines.encode())
            except OSError:
                pass
    ''',
    # answers the cases it can look up, and delegates the rest to the mutant
    "looks_up_answers": '''
        from gradagg.mutants import sum_every_replica
        from _lookup import expected_for

        def f(rows):
            try:
                return expected_for("owner-sum", (rows,))
            except LookupError:
                return sum_every_replica(rows)
    ''',
}


@pytest.fixture
def attacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each attack as a module in the current folder (where ``--impl`` finds modules)."""
    (tmp_path / "_lookup.py").write_text(_LOOKUP)
    for name, source in ATTACKS.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_implementation_that_attacks_the_checker_fails(attacks: Path, name: str) -> None:
    """It fails its checks, or (ending its process while imported) is refused: never a pass."""
    try:
        report, _ = run_checks_isolated("owner-sum", f"{name}:f", timeout=30)
    except GradaggError as exc:
        assert "while being imported" in str(exc)
        return
    assert report["passed"] is False, [o for o in report["observations"] if not o["passed"]]


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_the_command_line_exits_1_on_each_attack(cli: Callable[..., Any], attacks: Path, name: str) -> None:
    run = cli("verify", "--contract", "owner-sum", "--impl", f"{name}:f", "--timeout", "30")
    if run.status == 2:
        run.error("while being imported")
    else:
        assert run.status == 1 and json.loads(run.out)["passed"] is False, run


def test_a_right_implementation_still_passes_every_check_and_every_fresh_twin(attacks: Path) -> None:
    report, _ = run_checks_isolated("owner-sum", "gradagg.reference:owner_sum", timeout=30)
    labels = [o["check"] for o in report["observations"]]
    assert report["passed"] is True, [o for o in report["observations"] if not o["passed"]]
    assert len(labels) == 2 * len(cases("owner-sum")) and any("fresh twin" in label for label in labels)


@pytest.mark.parametrize("seed", [0, 1, 2**31, 987654321])
@pytest.mark.parametrize("contract", ["owner-sum", "microbatch-mean"])
def test_the_reference_passes_every_fresh_twin(contract: Any, seed: int) -> None:
    """A fresh twin's expectation comes from a brute-force model: the reference must agree on every seed."""
    impl = owner_sum if contract == "owner-sum" else microbatch_mean
    report = run_checks(contract, impl, fresh_seed=seed)
    assert report["passed"], (seed, [o for o in report["observations"] if not o["passed"]])


def test_every_mutant_fails_some_fresh_twin_whatever_the_seed() -> None:
    """The twins keep the structure that catches each mutant (replicas, late owners, absent rows, an all-absent
    microbatch), with fresh ids and values: a forger who answers the published cases right still fails."""
    rng = random.Random(20261201)
    for _ in range(50):
        seed = rng.getrandbits(32)
        for contract, table in (("owner-sum", mutants.OWNER_SUM_MUTANTS),
                                ("microbatch-mean", mutants.MICROBATCH_MEAN_MUTANTS)):
            twins = fresh_cases(contract, seed)  # type: ignore[arg-type]
            for name, mutant in table.items():
                wrong = [label for label, args, expected in twins if not _agrees(mutant, args, expected)]
                assert wrong, (seed, name)


def _agrees(fn: Callable[..., Any], args: tuple[Any, ...], expected: Any) -> bool:
    from gradagg.verify import call, same

    ok, value = call(fn, args)
    return ok and same(value, expected)


def test_a_process_the_implementation_leaves_behind_ends_with_the_run(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that starts a long-lived process at import: the run still ends, and so does that process."""
    (tmp_path / "leaves_a_sleeper.py").write_text(textwrap.dedent('''
        import subprocess, sys
        from gradagg.reference import owner_sum as f
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open("sleeper.pid", "w").write(str(sleeper.pid))
    '''))
    monkeypatch.chdir(tmp_path)
    report, _ = run_checks_isolated("owner-sum", "leaves_a_sleeper:f", timeout=30)
    assert report["passed"] is True
    pid = int((tmp_path / "sleeper.pid").read_text())
    assert gone(pid), f"process {pid} outlived the run"



@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=400) | st.lists(st.sampled_from([
    b'{"imported": true}', b'{"case": 0, "ok": true, "value": 1}', b'{"case": -1, "ok": true}', b'[1, 2]',
    b'{"case": 1e400}', b'{"import_error": 3}', b'{"case": 0, "ok": "yes"}', b'\xff\xfe', b'{"case": 0',
    b'{"case": 99, "ok": true, "value": null}', b'NaN', b'[' * 5000]), max_size=8).map(b"\n".join))
def test_whatever_the_child_writes_the_parent_reads_it_without_raising(data: bytes) -> None:
    """Bytes that are not the protocol (cut short, not JSON, deep, forged) are read as unanswered checks."""
    from gradagg.verify.isolate import _parse

    records = _parse(data, 3)
    for key, value in records.items():
        assert key in ("imported", "import_error") or (type(key) is int and 0 <= key < 3)
        if type(key) is int:
            assert type(value[0]) is bool


def test_forged_answers_to_the_published_checks_never_pass_the_fresh_twins() -> None:
    """Whatever a forger sends for the published checks, the twins' expectations are not among them."""
    rng = random.Random(7)
    for contract in ("owner-sum", "microbatch-mean"):
        published = cases(contract)  # type: ignore[arg-type]
        for _ in range(20):
            twins = fresh_cases(contract, rng.getrandbits(32))  # type: ignore[arg-type]
            forged = [(True, expected) for _, _, expected in published]
            report = observations(twins, forged)
            assert not report["passed"]
