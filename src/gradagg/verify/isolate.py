"""A user's ``MODULE:FUNCTION`` checked in a child process; the parent judges.

The child (:mod:`gradagg.verify.child`, run as program text) receives the arguments of every check
over a pipe this process created, and answers over another; its output goes to a file. The
expected values never leave this process, and besides the published checks the child is asked a
fresh twin of each, drawn from a seed it never sees: an implementation that answers from the
published cases, replaces the checker's functions or writes into the checker's channels still has
to compute those. Whatever the child leaves running ends with it (its own session, killed).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gradagg.errors import GradaggError
from gradagg.options import Contract
from gradagg.verify.run import all_checks, observations

_CHILD = Path(__file__).with_name("child.py")


def run_checks_isolated(contract: Contract, spec: str, *, timeout: float = 60.0,
                        fresh_seed: int | None = None) -> tuple[dict[str, Any], str]:
    """Import ``spec`` (``MODULE:FUNCTION``) in a child Python process and run every check of ``contract`` there.

    The child runs in the current folder (so a module there can be named); its standard output and
    error are collected, never mixed into the report. A check the child did not answer (it ended its
    process, or ``timeout`` ran out) fails, with the reason as its ``actual``. After the published
    checks come their fresh twins (labels ``"... (fresh twin, seed S)"``; ``run_checks(contract, f,
    fresh_seed=S)`` replays them in this process).

    Args:
        contract: ``"owner-sum"`` or ``"microbatch-mean"``.
        spec: ``"module:function"``, e.g. ``"gradagg.mutants:first_replica"``.
        timeout: seconds for the whole run, import included.
        fresh_seed: the twins' seed; default: drawn at random for this run.

    Returns:
        ``(report, output)``: the report as :func:`gradagg.verify.run_checks` gives it, and what the
        child printed (its stdout and stderr together).

    Raises:
        GradaggError: ``spec`` is not ``MODULE:FUNCTION``; the module cannot be imported (or ends the
            process, or hangs, while importing); it has no such attribute, or the attribute is not callable.

    >>> report, output = run_checks_isolated("owner-sum", "gradagg.mutants:first_replica")
    >>> report["passed"], output
    (False, '')
    """
    module_name = split_spec(spec)[0]
    checks = all_checks(contract, secrets.randbits(32) if fresh_seed is None else fresh_seed)
    requests = "".join(json.dumps(list(args)) + "\n" for _, args, _ in checks)
    status, output, answers = _run_child(spec, requests, timeout)
    records = _parse(answers, len(checks))
    ended = f"timed out after {timeout:g} s" if status is None else f"ended its process (exit status {status})"
    if "import_error" in records:
        raise GradaggError(f"--impl {spec}: {records['import_error']}")
    if "imported" not in records:
        printed = f"; it printed: {output}" if output.strip() else ""
        raise GradaggError(f"--impl {spec}: module {module_name!r} {ended} while being imported{printed}")
    missing = (False, f"not run: the implementation {ended} before this check")
    return observations(checks, [records.get(k, missing) for k in range(len(checks))]), output


def split_spec(spec: str) -> tuple[str, str]:
    """``"module:function"`` -> ``("module", "function")``.

    >>> split_spec("gradagg.mutants")
    Traceback (most recent call last):
    ...
    gradagg.errors.GradaggError: --impl must be MODULE:FUNCTION, got 'gradagg.mutants'
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GradaggError(f"--impl must be MODULE:FUNCTION, got {spec!r}")
    return module_name, attr


def _run_child(spec: str, requests: str, timeout: float) -> tuple[int | None, str, bytes]:
    """Run the child; return (exit status, or None on timeout; what it printed; its answers, raw)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds gradagg
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    with tempfile.TemporaryFile() as out:  # a file, not a pipe: nothing the child leaves running can block us
        try:
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD.read_text(encoding="utf-8"), spec, str(requests_r), str(answers_w)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                pass_fds=(requests_r, answers_w))
        finally:
            os.close(requests_r)
            os.close(answers_w)
        threading.Thread(target=_write_all, args=(requests_w, requests.encode()), daemon=True).start()
        try:
            answers, status = _read_answers(answers_r, child, time.monotonic() + timeout)
        finally:
            os.close(answers_r)
            _end_session(child)
        out.seek(0)
        return status, out.read().decode("utf-8", "replace"), answers


def _write_all(fd: int, data: bytes) -> None:
    """The requests, then end of file; a child that died first leaves a broken pipe, which is its failure."""
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:
        pass


def _read_answers(fd: int, child: subprocess.Popen[bytes], deadline: float) -> tuple[bytes, int | None]:
    """Everything the child writes until it closes its end or exits (status), or the deadline (None)."""
    chunks: list[bytes] = []
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([fd], [], [], min(left, 0.1))
        if readable:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        elif child.poll() is not None:
            break  # exited, but something it started holds the pipe open: what was written is all there is
    else:
        return b"".join(chunks), None
    try:
        return b"".join(chunks), child.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return b"".join(chunks), None


def _end_session(child: subprocess.Popen[bytes]) -> None:
    """Kill the child's session: the child, and anything it started that is still there."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing of it is left
    child.wait()


def _parse(answers: bytes, n: int) -> dict[Any, Any]:
    """The child's records; the first answer to each check counts; a malformed line ends the reading."""
    records: dict[Any, Any] = {}
    for line in answers.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            break  # a line cut short when the child died, or not ours: every check after it is unanswered
        if not isinstance(record, dict):
            break
        k = record.get("case")
        if type(k) is int and 0 <= k < n and type(record.get("ok")) is bool:
            records.setdefault(k, (record["ok"], record.get("value")))
        elif record.get("imported") is True:
            records.setdefault("imported", True)
        elif isinstance(record.get("import_error"), str):
            records.setdefault("import_error", record["import_error"])
    return records
