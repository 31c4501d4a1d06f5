"""Shared fixtures: the case documents' checks (defined once, in :mod:`gradagg.verify`) and the command line.

``cli`` runs ``gradagg ARGS`` in this process (fast: used by the fuzz tests);
``cli_process`` runs it as a real ``python -m gradagg`` process (exit status,
stderr and signals exactly as a user sees them). Both return a :class:`Run`.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from gradagg import cli as gradagg_cli
from gradagg.verify import MICROBATCH_MEAN_DOCUMENT, OWNER_SUM_DOCUMENT, Case

try:
    from gradagg.testing import also_preload
except ImportError:  # no torch here: no local worlds either
    pass
else:
    # Every local world of the session forks from one server: what most ranks import (FSDP2, which imports
    # torch._dynamo at its first fully_shard; the pipeline schedules) is imported there once instead of per rank.
    also_preload(["torch.distributed.fsdp", "torch._dynamo", "torch.distributed.pipelining"])


class Run(NamedTuple):
    """One run of the command line: exit status, standard output and standard error (a tuple of the three)."""

    status: int
    out: str
    err: str

    def ok(self) -> str:
        """Assert success with nothing on stderr; return stdout."""
        assert self.status == 0 and self.err == "", (self.status, self.out, self.err)
        return self.out

    def error(self, fragment: str = "") -> str:
        """Assert the usage/input error form: exit 2, nothing on stdout, one line on stderr; return that line."""
        assert self.status == 2, (self.status, self.out, self.err)
        assert self.out == "", self.out
        assert self.err.startswith("gradagg: error: ") and self.err.count("\n") == 1, self.err
        assert self.err.endswith("\n") and "Traceback" not in self.err, self.err
        assert fragment in self.err, (fragment, self.err)
        return self.err


def run_in_process(*args: str, stdin: bytes = b"") -> Run:
    """``gradagg ARGS`` through :func:`gradagg.cli.main` in this process, standard input given as bytes."""
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = gradagg_cli.main(list(args))
            except SystemExit as exc:  # argparse and _fail exit; main() returns otherwise
                status = exc.code if isinstance(exc.code, int) else 0
    finally:
        sys.stdin = old_stdin
    return Run(status, out.getvalue(), err.getvalue())


def run_process(*args: str, stdin: bytes = b"", cwd: Path | None = None, timeout: float = 60) -> Run:
    """``python -m gradagg ARGS`` as a real process."""
    proc = subprocess.run([sys.executable, "-m", "gradagg", *args], input=stdin, capture_output=True, cwd=cwd,
                          timeout=timeout)
    return Run(proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace"))


@pytest.fixture(scope="session")
def cli() -> Callable[..., Run]:
    """Run the command line in this process: ``cli("owner-sum", path, stdin=b"...")``."""
    return run_in_process


@pytest.fixture(scope="session")
def cli_process() -> Callable[..., Run]:
    """Run the command line as a real ``python -m gradagg`` process."""
    return run_process


def _label(case: Any) -> str:
    return str(case[0])


@pytest.fixture(params=OWNER_SUM_DOCUMENT, ids=_label)
def owner_sum_document_case(request: pytest.FixtureRequest) -> Case:
    """Each of the owner-sum case document's 6 checks: ``(label, (rows,), expected)``."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(params=MICROBATCH_MEAN_DOCUMENT, ids=_label)
def microbatch_mean_document_case(request: pytest.FixtureRequest) -> Case:
    """Each of the microbatch-mean case document's 7 checks: ``(label, (rows, active_counts), expected)``."""
    return request.param  # type: ignore[no-any-return]
