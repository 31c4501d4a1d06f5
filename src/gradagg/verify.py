"""The contract checks, reported as observations in the case documents' form.

:func:`run_checks` runs every check of one contract against a function in this
process (the built-in one by default); :func:`run_checks_isolated` imports a
user's ``MODULE:FUNCTION`` in a child process and runs the same checks there.
Both return ``{"observations": [{"check", "actual", "expected", "passed"}, ...], "passed": bool}``.

The checks are the case documents' 13 (:data:`OWNER_SUM_DOCUMENT`, 6, and
:data:`MICROBATCH_MEAN_DOCUMENT`, 7: the only definition of those fixtures;
the tests import them) plus our own: seeded random cases against an
independent brute-force model, order independence, replica rows that never
count, absent versus zero, an all-absent microbatch that still counts in M,
NaN as a value. Random cases use integer values so that any correct
implementation, whatever its summation order, matches exactly.

Whatever a checked function does (raise, call ``sys.exit``, print, return an
object that claims to equal anything), only a plain result equal to the
expected one passes: results are turned into plain lists, numbers and strings
(:func:`plain`) before they are compared. In a child process it may also end
the process or hang: the checks it did not answer fail.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

from gradagg.errors import GradaggError
from gradagg.options import Contract
from gradagg.reference import microbatch_mean, owner_sum

Case: TypeAlias = tuple[str, tuple[Any, ...], Any]  # (label, call arguments, expected)

SEED = 20261129  # fixed, so a failing observation can be replayed exactly

_DOC_ROWS = [["x", "a", "a", 1], ["x", "b", "a", 9], ["y", "c", "c", 2]]
OWNER_SUM_DOCUMENT: tuple[Case, ...] = (
    ("ignore replica copy", (_DOC_ROWS,), [["x", 1], ["y", 2]]),
    ("empty owners", ([],), []),
    ("only nonowner", ([["z", "b", "a", 1]],), []),
    ("owner can be late", ([["z", "b", "a", 1], ["z", "a", "a", 3]],), [["z", 3]]),
    ("several owners", ([["b", "b", "b", 1], ["a", "a", "a", 2]],), [["a", 2], ["b", 1]]),
    ("owner contributions add", ([["q", "q", "q", 1], ["q", "q", "q", 2]],), [["q", 3]]),
)
"""The owner-sum case document's 6 checks, verbatim (its scale factor N is 1)."""

MICROBATCH_MEAN_DOCUMENT: tuple[Case, ...] = (
    ("missing treated as zero", ([[2, None], [4, 6]], [1, 2]), [3, 3]),
    ("all present", ([[2, 4], [6, 8]], [2, 2]), [4, 6]),
    ("single missing", ([[None, 5]], [0, 1]), [0, 5]),
    ("empty rows", ([], []), []),
    ("zero active count", ([[0, None], [0, None]], [0, 0]), [0, 0]),
    ("late participation", ([[None, 2], [9, None], [3, 4]], [1, 1, 2]), [4, 2]),
    ("zero gradient", ([[0, None], [4, 2]], [1, 1]), [2, 1]),
)
"""The microbatch-mean case document's 7 checks, verbatim (its scale factor N is 1)."""


def run_checks(contract: Contract, impl: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Run every check of ``contract`` against ``impl`` (default: the built-in one), in this process.

    Args:
        contract: ``"owner-sum"`` or ``"microbatch-mean"``.
        impl: a function with the contract's signature: ``f(rows)`` for
            owner-sum, ``f(rows, active_counts)`` for microbatch-mean. Each
            call gets its own copy of the arguments.

    Returns:
        ``{"observations": [...], "passed": bool}``. An implementation that
        raises (``SystemExit`` included) fails that check; the exception is
        recorded as its ``actual``.

    >>> run_checks("owner-sum")["passed"]
    True
    """
    if impl is None:
        impl = owner_sum if contract == "owner-sum" else microbatch_mean
    answers = [call(impl, args) for _, args, _ in cases(contract)]
    return observations(contract, answers)


def cases(contract: Contract) -> list[Case]:
    """Every check of ``contract``: the case document's, then ours (the same list on every call).

    >>> [label for label, _, _ in cases("owner-sum")][:2]
    ['ignore replica copy', 'empty owners']
    """
    return owner_sum_cases() if contract == "owner-sum" else microbatch_mean_cases()


def call(impl: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """``(True, plain result)`` of ``impl(*args)`` on a copy of ``args``, or ``(False, "raised ...")``.

    >>> call(len, (["a", "b"],))
    (True, 2)
    """
    try:
        return True, plain(impl(*copy.deepcopy(args)))
    except (Exception, SystemExit) as exc:  # a user's function may fail in any way; that is a failed check
        return False, f"raised {type(exc).__name__}: {exc}"


def plain(value: Any) -> Any:
    """``value`` as plain JSON-able data: lists, ``int``, ``float``, ``str``, ``bool``, ``None``.

    Subclasses become their base type (NumPy's float64 is a float); anything else
    becomes ``{"unrepresentable": description}``, which equals no expected value.

    >>> plain((1, [2.5, None]))
    [1, [2.5, None]]
    """
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value) if value.bit_length() < 14_000 else {"unrepresentable": "an int of over 4200 digits"}
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return {"unrepresentable": f"{type(value).__name__} {_short_repr(value)}"}


def observations(contract: Contract, answers: Sequence[tuple[bool, Any]]) -> dict[str, Any]:
    """Compare ``answers`` (one :func:`call` result per case, in order) with the expected values.

    >>> answers = [call(microbatch_mean, args) for _, args, _ in cases("microbatch-mean")]
    >>> observations("microbatch-mean", answers)["passed"]
    True
    """
    result = []
    for (label, _, expected), (ok, value) in zip(cases(contract), answers, strict=True):
        actual = _json(value) if ok else value
        result.append({"check": label, "actual": actual, "expected": _json(expected),
                       "passed": ok and _same(value, expected)})
    return {"observations": result, "passed": all(o["passed"] for o in result)}


def _same(actual: Any, expected: Any) -> bool:
    """Equality of plain values where NaN equals NaN (NaN must propagate, so it is an expected value)."""
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(actual, float) and math.isnan(actual)
    if isinstance(expected, list):
        return isinstance(actual, list) and len(actual) == len(expected) and all(
            _same(a, e) for a, e in zip(actual, expected)
        )
    if isinstance(expected, str):
        return type(actual) is str and actual == expected
    return type(actual) in (int, float) and actual == expected


def _json(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become strings (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, list):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return value.get("unrepresentable", repr(value))
    return value


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a user's object may fail even to print itself
        text = f"<repr raised {type(exc).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


# --- a user's function, in a child process ------------------------------------------------

_CHILD = "import sys; from gradagg.verify import _child; _child(*sys.argv[1:])"


def run_checks_isolated(contract: Contract, spec: str, *, timeout: float = 60.0) -> tuple[dict[str, Any], str]:
    """Import ``spec`` (``MODULE:FUNCTION``) in a child Python process and run every check of ``contract`` there.

    The child runs in the current folder (so a module there can be named); its
    standard output and error are collected, never mixed into the report. A
    check the child did not answer (it ended its process, or ``timeout`` ran
    out) fails, with the reason as its ``actual``.

    Args:
        contract: ``"owner-sum"`` or ``"microbatch-mean"``.
        spec: ``"module:function"``, e.g. ``"gradagg.mutants:first_replica"``.
        timeout: seconds for the whole run, import included.

    Returns:
        ``(report, output)``: the report as :func:`run_checks` gives it, and
        what the child printed (its stdout and stderr together).

    Raises:
        GradaggError: ``spec`` is not ``MODULE:FUNCTION``; the module cannot be
            imported (or ends the process, or hangs, while importing); it has no
            such attribute, or the attribute is not callable.

    >>> report, output = run_checks_isolated("owner-sum", "gradagg.mutants:first_replica")
    >>> report["passed"], output
    (False, '')
    """
    module_name, _ = _split_spec(spec)
    with tempfile.TemporaryDirectory(prefix="gradagg-verify-") as tmp:
        channel = os.path.join(tmp, "answers.jsonl")
        status, output = _run_child([contract, spec, channel], os.path.join(tmp, "output"), timeout)
        records = _read_answers(channel)
    ended = f"timed out after {timeout:g} s" if status is None else f"ended its process (exit status {status})"
    if "import_error" in records:
        raise GradaggError(f"--impl {spec}: {records['import_error']}")
    if "imported" not in records:
        printed = f"; it printed: {output}" if output.strip() else ""
        raise GradaggError(f"--impl {spec}: module {module_name!r} {ended} while being imported{printed}")
    missing = (False, f"not run: the implementation {ended} before this check")
    answers = [records.get(k, missing) for k in range(len(cases(contract)))]
    return observations(contract, answers), output


def _split_spec(spec: str) -> tuple[str, str]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GradaggError(f"--impl must be MODULE:FUNCTION, got {spec!r}")
    return module_name, attr


def _run_child(argv: list[str], output_path: str, timeout: float) -> tuple[int | None, str]:
    """Run the child; return (exit status, or None on timeout; its output). Output goes to a file, not a pipe,
    so that nothing the child leaves running can block this process."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds gradagg
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with open(output_path, "wb") as out:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, *argv], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status: int | None = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # its own session: whatever it started goes too
            child.wait()
            status = None
    with open(output_path, "rb") as f:
        return status, f.read().decode("utf-8", "replace")


def _read_answers(channel: str) -> dict[Any, Any]:
    records: dict[Any, Any] = {}
    if not os.path.exists(channel):
        return records
    with open(channel, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                break  # a line cut short when the child died: every check after it is unanswered
            if "case" in record:
                records[record["case"]] = (record["ok"], record["value"])
            else:
                records.update(record)
    return records


def _child(contract: Contract, spec: str, channel: str) -> None:
    """The child's side: import ``spec``, answer every check of ``contract`` into ``channel``, one JSON line each."""
    with open(channel, "w", encoding="utf-8") as out:

        def send(record: dict[str, Any]) -> None:
            out.write(json.dumps(record) + "\n")
            out.flush()

        try:
            impl = _import(spec)
        except GradaggError as exc:
            send({"import_error": str(exc)})
        else:
            send({"imported": True})
            for k, (_, args, _) in enumerate(cases(contract)):
                ok, value = call(impl, args)
                send({"case": k, "ok": ok, "value": value})
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)  # not sys.exit: threads or exit hooks the implementation left behind must not keep the child alive


def _import(spec: str) -> Callable[..., Any]:
    module_name, attr = _split_spec(spec)
    sys.path.insert(0, os.getcwd())  # so a module in the current folder can be named (also under PYTHONSAFEPATH)
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:
        raise GradaggError(f"importing module {module_name!r} called sys.exit({exc.code!r})") from None
    except Exception as exc:  # any error raised by the user's module while it is imported
        raise GradaggError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, attr):
        raise GradaggError(f"module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise GradaggError(f"{attr!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


# --- owner-sum ---------------------------------------------------------------


def owner_sum_cases() -> list[Case]:
    """The 6 case-document checks, then ours."""
    cases: list[Case] = [
        *OWNER_SUM_DOCUMENT,
        ("stale replica after owner", ([["s", "a", "a", 4], ["s", "b", "a", 7]],), [["s", 4]]),
        ("integer ids sort numerically", ([[10, 0, 0, 1], [9, 1, 1, 2]],), [[9, 2], [10, 1]]),
        ("vector gradients add element-wise",
         ([["v", 0, 0, [1, 2]], ["v", 1, 0, [9, 9]], ["v", 0, 0, [3, 4]]],), [["v", [4, 6]]]),
        ("large integers stay exact", ([["i", 0, 0, 2**60], ["i", 0, 0, 1]],), [["i", 2**60 + 1]]),
        ("nan in owner row propagates", ([["n", 0, 0, float("nan")]],), [["n", float("nan")]]),
        ("nan in replica row is not counted", ([["n", 1, 0, float("nan")], ["n", 0, 0, 5]],), [["n", 5]]),
    ]
    rng = random.Random(SEED)
    for k in range(4):
        rows = _random_owner_rows(rng)
        cases.append((f"random case {k} (seed {SEED}) against brute force", (rows,), _brute_owner_sum(rows)))
    cases.extend(_owner_sum_metamorphic(rng))
    return cases


def _random_owner_rows(rng: random.Random) -> list[list[Any]]:
    shards = [f"s{k}" for k in range(rng.randint(1, 8))]
    workers = list(range(4))
    owner_of = {s: rng.choice(workers) for s in shards}
    rows = []
    for _ in range(rng.randint(0, 40)):
        s = rng.choice(shards)
        rows.append([s, rng.choice(workers), owner_of[s], rng.randint(-1000, 1000)])
    return rows


def _brute_owner_sum(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """An independent formulation: for each shard with an owner row, add its owner rows."""
    owned = sorted({r[0] for r in rows if r[1] == r[2]})
    return [[s, sum(r[3] for r in rows if r[0] == s and r[1] == r[2])] for s in owned]


def _owner_sum_metamorphic(rng: random.Random) -> Iterator[Case]:
    rows = _random_owner_rows(rng) + [["t", 0, 0, 11]]
    expected = _brute_owner_sum(rows)
    shuffled = rows[:]
    rng.shuffle(shuffled)
    yield ("any permutation gives the same result", (shuffled,), expected)
    stale = rows + [[r[0], "replica", r[2], 10**6] for r in rows]
    yield ("added non-owner rows never change the result", (stale,), expected)
    split = [["t", 0, 0, 5], ["t", 0, 0, 6]] + [r for r in rows if r[0] != "t"]
    yield ("an owner gradient split over two rows gives the same total", (split,), expected)


# --- microbatch mean ---------------------------------------------------------


def microbatch_mean_cases() -> list[Case]:
    """The 7 case-document checks, then ours."""
    cases: list[Case] = [
        *MICROBATCH_MEAN_DOCUMENT,
        ("absent and explicit zero give the same mean", ([[None, 3], [6, 3]], [1, 2]), [3, 3]),
        ("active counts are never the divisor", ([[2, None], [4, 6]], [100, 7]), [3, 3]),
        ("parameter absent everywhere has mean zero", ([[None, 1], [None, 3]], [1, 1]), [0, 2]),
        # M counts every microbatch run, also one in which no parameter received a gradient.
        ("an all-absent microbatch still counts in M", ([[2, 4], [None, None], [4, 2]], [2, 2]), [2, 2]),
        ("nan is a value, not absence", ([[float("nan"), None], [1, 1]], [2, 1]), [float("nan"), 0.5]),
    ]
    rng = random.Random(SEED + 1)
    for k in range(4):
        rows = _random_microbatches(rng)
        cases.append((f"random case {k} (seed {SEED + 1}) against brute force", (rows, None), _brute_mean(rows)))
    return cases


def _random_microbatches(rng: random.Random) -> list[list[Any]]:
    m, p = rng.randint(1, 9), rng.randint(1, 6)
    return [[None if rng.random() < 0.3 else rng.randint(-50, 50) for _ in range(p)] for _ in range(m)]


def _brute_mean(rows: Sequence[Sequence[Any]]) -> list[float]:
    """Column sums (absent as 0) over the counted number of microbatches."""
    m = len(rows)
    return [sum(0 if r[j] is None else r[j] for r in rows) / m for j in range(len(rows[0]))]
