"""The ``gradagg`` command line: parse, read, call, write; nothing else.

Exit status: 0 success, 1 a check failed (``verify``, ``demo``, ``parity``), 2 usage
or input error, reported as one line ``gradagg: error: ...`` on stderr, never a
traceback; 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), 129 hung up (SIGHUP):
an interrupted run leaves ``-o``'s file as it was and no temporary file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
from array import array
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any, NoReturn

from gradagg.errors import FormatError, GradaggError, OutputError
from gradagg.formats import detect, text
from gradagg.formats.atomic import check_target, write_atomic
from gradagg.options import CONTRACTS, ENGINES, FORMATS, NONFINITE
from gradagg.progress import progress_for

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{self.prog}: {message}" if " " in self.prog else message)


def _fail(message: str) -> NoReturn:
    one_line = " ".join(message.split())
    print(f"gradagg: error: {one_line}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; ``gradagg --help`` and each subcommand's ``--help`` come from here."""
    parser = _Parser(prog="gradagg", description="Exactly-once gradient aggregation: declared, checked, visible.")
    parser.add_argument("--version", action="version", version=f"gradagg {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_owner_sum(sub)
    _add_mean(sub)
    _add_verify(sub)
    _add_demo(sub)
    _add_parity(sub)
    return parser


def _add_input_options(p: argparse.ArgumentParser, formats: str) -> None:
    p.add_argument("file", metavar="FILE",
                   help="input file, or - for standard input: without --format its content tells the format "
                        "(Parquet by its magic bytes; text starting with [ or { is JSON or JSON Lines: several "
                        "lines whose first is a whole JSON value are JSON Lines; anything else is CSV)")
    p.add_argument("--format", choices=FORMATS, help=f"input format (default: from the extension; {formats})")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write the result to OUT atomically (.parquet writes Parquet, .csv CSV, anything else JSON) "
                        "instead of stdout; a symbolic link's target is replaced and the link kept; a FIFO or "
                        "character device (/dev/null) is written in place; a directory is refused")
    p.add_argument("--nonfinite", choices=NONFINITE, default="propagate",
                   help="NaN/Inf in a counted gradient: let it flow into the result (default) or fail")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default): the streaming numpy engine for Parquet, the pure-Python reference for "
                        "JSON/JSONL/CSV (there parsing the text dominates); python: the reference (reads the whole "
                        "file into memory); numpy, torch: the columnar engines")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress line (one is drawn on stderr for long Parquet inputs, only on a terminal)")


def _add_owner_sum(sub: Any) -> None:
    p = sub.add_parser("owner-sum", help="sum each shard's gradient over its owner's rows only",
                       description="Rows [shard_id, worker_id, owner_id, gradient]: sum the rows where worker equals "
                                   "owner, grouped by shard; print sorted [[shard, total], ...] as JSON.")
    _add_input_options(p, "JSON array of rows, JSON Lines of arrays or objects, CSV with the header "
                          "shard_id,worker_id,owner_id,gradient, Parquet columns of those names")
    p.set_defaults(handler=_run_owner_sum, header=None)


def _add_mean(sub: Any) -> None:
    p = sub.add_parser("mean", help="mean of each parameter over all microbatches, absent counting as zero",
                       description="M microbatches of P values (null/empty = absent): print the P means "
                                   "sum/M as JSON. Activity counters are accepted and never used as the divisor. "
                                   "In CSV, no line is ever skipped: a blank line is one empty cell, so an absent "
                                   "value in a one-column file and an error in a wider one.")
    _add_input_options(p, 'JSON {"rows": ..., "active_counts": ...} or array, JSON Lines, CSV; Parquet: one '
                          "column per microbatch, one row per parameter, null = absent")
    p.add_argument("--header", action=argparse.BooleanOptionalAction, default=None,
                   help="CSV only: the first line is a header of parameter names (--header) or a microbatch "
                        "(--no-header). Default: a header when every cell is a name (not a number, not empty), a "
                        "microbatch when every cell is a number or empty, otherwise an error naming the line")
    p.set_defaults(handler=_run_mean)


def _add_verify(sub: Any) -> None:
    p = sub.add_parser("verify", help="run the contract checks and print the observations as JSON",
                       description="Run the contract checks against the built-in implementation or a function of "
                                   "yours; exit 0 if every check passes, 1 otherwise.")
    p.add_argument("--contract", choices=(*CONTRACTS, "all"), default="all", help="which contract (default: all)")
    p.add_argument("--impl", metavar="MODULE:FUNCTION",
                   help="check this function instead of the built-in one (needs --contract owner-sum or "
                        "microbatch-mean), run in a child process in the current folder: what it prints goes to "
                        "stderr, and a check it does not answer (it exits or hangs) fails; "
                        "e.g. gradagg.mutants:first_replica")
    p.add_argument("--timeout", metavar="SECONDS", type=_seconds, default=60.0,
                   help="with --impl: fail the checks not answered within this many seconds (default: 60)")
    p.set_defaults(handler=_run_verify)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a small model on 2 local processes and compare with the full batch",
                       description="The main job: distributed training with gradagg against the single-process "
                                   "full-batch gradient and the known wrong approaches.")
    _lazy(p, "gradagg.demo")


def _add_parity(sub: Any) -> None:
    p = sub.add_parser("parity", help="check your own distributed training step against the one-process full batch",
                       description="Run SCRIPT.py's step() on local gloo worlds of several microbatch layouts and "
                                   "compare every gradient with the full-batch one; print the observations as JSON; "
                                   "exit 0 if every layout matches, 1 otherwise.")
    _lazy(p, "gradagg.parity")


def _lazy(parser: argparse.ArgumentParser, module: str) -> None:
    """Give ``parser`` its options and handler from ``module`` (``add_arguments``, ``run``) only when it parses."""
    parser.__class__ = _LazyParser  # add_parser takes no parser class before Python 3.13; same fields, one more method
    parser.set_defaults(lazy_module=module)


class _LazyParser(_Parser):
    """A subcommand's parser that imports its module only when that subcommand is parsed.

    Importing the demo module costs ~30 ms, a tenth of a whole ``gradagg owner-sum`` on a 10^7-row file;
    argparse asks a subcommand's parser to parse only when that subcommand was named.
    """

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.get_default("handler") is None:
            module = importlib.import_module(self.get_default("lazy_module"))  # light: torch loads when it runs
            module.add_arguments(self)
            self.set_defaults(handler=module.run)
        return super().parse_known_args(args, namespace)


# --- handlers --------------------------------------------------------------------


def _run_owner_sum(args: argparse.Namespace) -> int:
    from gradagg import engine

    source = _open_input(args, "owner-sum")
    with _input_errors(source), progress_for(quiet=args.quiet, stream=sys.stderr) as progress:
        if source.fmt == "parquet":
            shards, totals = _owner_sum_parquet(args, progress)
        else:
            rows = text.read_owner_rows(source.text(), source.fmt, source.name)
            result = engine.owner_sum_rows(rows, engine=args.engine, nonfinite=args.nonfinite)
            shards, totals = [s for s, _ in result], [t for _, t in result]
    if _is_parquet(args.output):
        _write_owner_sum_parquet(args.output, shards, totals)
    else:
        # array.array (the native backend's columns) holds plain ints and floats already, and text writes it in C.
        plain = [c if isinstance(c, array) else engine.python_values(c) for c in (shards, totals)]
        _emit(text.Columns(*plain), args.output, "owner-sum")
    return EXIT_OK


def _run_mean(args: argparse.Namespace) -> int:
    from gradagg import engine

    source = _open_input(args, "microbatch-mean")
    with _input_errors(source), progress_for(quiet=args.quiet, stream=sys.stderr) as progress:
        if source.fmt == "parquet":
            means = _mean_parquet(args, progress)
        else:
            rows, counts = text.read_microbatches(source.text(), source.fmt, source.name, header=args.header)
            means = engine.microbatch_mean_rows(rows, counts, engine=args.engine, nonfinite=args.nonfinite)
    if _is_parquet(args.output):
        _parquet().write_mean(args.output, means)
    else:
        _emit(engine.python_values(means), args.output, "microbatch-mean")
    return EXIT_OK


def _open_input(args: argparse.Namespace, contract: str) -> detect.Input:
    """Check ``-o`` (before any work), find the input's format and read a text input whole."""
    if args.output is not None:
        check_target(args.output)
    source = detect.read_input(args.file, args.format, contract, getattr(sys.stdin, "buffer", None))
    text.check_header(args.header, source.fmt, source.name)
    args.source = source.parquet  # what _owner_sum_parquet and _mean_parquet read: a path, or stdin's bytes
    return source


@contextlib.contextmanager
def _input_errors(source: detect.Input) -> Iterator[None]:
    """On standard input recognised by content, say which reading failed and which option chooses another."""
    try:
        yield
    except FormatError as exc:
        if not source.sniffed:
            raise
        others = " or ".join(f for f in ("json", "jsonl", "csv") if f != source.fmt)
        raise FormatError(f"{exc} (standard input was read as {source.fmt}, recognised by its content; "
                          f"pass --format {others} to read it otherwise)") from None


def _run_verify(args: argparse.Namespace) -> int:
    from gradagg.verify import run_checks, run_checks_isolated

    if args.impl is not None and args.contract == "all":
        _fail("--impl checks one contract: add --contract owner-sum or --contract microbatch-mean")
    contracts = CONTRACTS if args.contract == "all" else (args.contract,)
    observations: list[dict[str, Any]] = []
    for contract in contracts:
        if args.impl is None:
            report = run_checks(contract)
        else:
            report, printed = run_checks_isolated(contract, args.impl, timeout=args.timeout)
            sys.stderr.write(printed if printed.endswith("\n") or not printed else printed + "\n")
        for obs in report["observations"]:
            label = obs["check"] if len(contracts) == 1 else f"{contract}: {obs['check']}"
            observations.append({**obs, "check": label})
    passed = all(o["passed"] for o in observations)
    print(json.dumps({"observations": observations, "passed": passed}))
    return EXIT_OK if passed else EXIT_FAILED


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def _is_parquet(output: str | None) -> bool:
    return output is not None and output.lower().endswith(".parquet")


# --- Parquet (the columnar side's code: owned by the engine/Parquet helper) -----------------


def _owner_sum_parquet(args: argparse.Namespace, progress: Any) -> tuple[Any, Any]:
    """Owner-sum over the Parquet input ``args.source`` (a path, or standard input as a file): (shards, totals).

    The native reader takes the file when it can (decided from the footer, before any row): no pyarrow, no
    NumPy; otherwise pyarrow reads all of it. Either way the engine then chooses the backend.
    """
    from gradagg.engine import owner_sum_batches
    from gradagg.formats import parquet_native

    batches = parquet_native.owner_batches(args.source, progress=progress)
    if batches is None:
        batches = _parquet().owner_batches(args.source, progress=progress)
    return owner_sum_batches(batches, engine=args.engine, nonfinite=args.nonfinite)  # type: ignore[no-any-return]


def _write_owner_sum_parquet(output: str, shards: Any, totals: Any) -> None:
    """Write ``-o OUT.parquet``: the native backend's arrays without pyarrow (the native writer), else with it."""
    from gradagg.formats import parquet_native_write

    if not parquet_native_write.write_owner_sum(output, shards, totals):
        _parquet().write_owner_sum(output, shards, totals)


def _mean_parquet(args: argparse.Namespace, progress: Any) -> Any:
    """The microbatch mean over the Parquet input ``args.source`` (a path, or standard input as a file)."""
    from gradagg.engine import microbatch_mean_batches

    batches = _parquet().microbatch_batches(args.source, progress=progress)
    return microbatch_mean_batches(batches, engine=args.engine, nonfinite=args.nonfinite)


def _parquet() -> Any:
    """:mod:`gradagg.formats.parquet`, imported only when a Parquet file is read or written (pyarrow, numpy)."""
    try:
        return importlib.import_module("gradagg.formats.parquet")
    except ImportError as exc:
        _fail(f"Parquet needs pyarrow and numpy ({exc}); install them with: pip install 'gradagg[parquet]'")


def _emit(result: Any, output: str | None, contract: str) -> None:
    """JSON (ASCII: any string survives any terminal) on stdout or in OUT, or CSV in OUT when it ends in .csv."""
    if output is None and sys.stdout is None:
        raise OutputError("standard output is closed; pass -o OUT to write the result to a file")
    if output is None:
        print(text.dumps_result(result))
    elif output.lower().endswith(".csv"):
        write_atomic(output, text.encode_csv(text.result_to_csv(result, contract), output))
    else:
        write_atomic(output, (text.dumps_result(result) + "\n").encode("ascii"))


def _version() -> str:
    from gradagg import __version__

    return __version__


def _keep_numba_out() -> None:
    """Run the NumPy engine without numba in this process, unless ``GRADAGG_NUMBA`` says otherwise.

    The numpy engine compiles its fused loops with numba when it can import it
    (same answers either way; the engine tests check both paths). In a command
    that runs once, importing numba and loading its cached kernels costs ~0.5 s
    and more at exit: more than the kernels save on a 10^7-row file, where the
    whole run takes about as long (bench/RESULTS.md). ``GRADAGG_NUMBA=1``
    lets numba back in; the switch is read by :mod:`gradagg.backends._kernels`.
    """
    os.environ.setdefault("GRADAGG_NUMBA", "0")


# --- entry point -----------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Called as the program (``argv`` None: the ``gradagg`` script, ``python -m
    gradagg``), the process is short-lived, so numba is kept out of it (see
    :func:`_keep_numba_out`), and SIGTERM and SIGHUP become exceptions, so that
    an output being written is cleaned up as on Ctrl-C. Called with an
    ``argv`` list, nothing global changes.
    """
    args = build_parser().parse_args(argv)
    if argv is None:
        _raise_on_termination()
        if args.command in ("owner-sum", "mean"):
            _keep_numba_out()
    try:
        return int(args.handler(args))
    except GradaggError as exc:
        _fail(str(exc))
    except BrokenPipeError:
        # The reader went away (`gradagg ... | head`): not an input error. Point stdout at
        # /dev/null so Python's flush at exit does not complain, and exit like `head`'s writers do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        # File not found, permission denied, a full disk: name the file and the reason.
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(f"{where}{exc.strerror or exc}")
    except KeyboardInterrupt:
        print("gradagg: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except _Terminated as exc:
        print(f"gradagg: stopped by {exc.signal.name}", file=sys.stderr)
        return 128 + exc.signal


class _Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the program is so that cleanup runs (a BaseException, like Ctrl-C's)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


def _raise_on_termination() -> None:
    """Turn SIGTERM and SIGHUP into :class:`_Terminated`, unless the caller set them otherwise (e.g. nohup)."""
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _terminate)


def _terminate(signum: int, frame: FrameType | None) -> NoReturn:
    raise _Terminated(signum)


if __name__ == "__main__":
    sys.exit(main())
