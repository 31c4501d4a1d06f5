"""The ``gradagg`` command line: parse, read, call, write; nothing else.

Exit status: 0 success, 1 a check failed (``verify``, ``demo``, ``parity``), 2 usage
or input error, reported as one line ``gradagg: error: ...`` on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gradagg.errors import GradaggError
from gradagg.formats import text as io
from gradagg.formats.atomic import write_atomic
from gradagg.progress import progress_for
from gradagg.reference import NonFinite, microbatch_mean, owner_sum
from gradagg.verify import CONTRACTS, run_checks

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# The engine names of gradagg.engine.ENGINES, repeated so that `gradagg --help` imports no engine code.
ENGINES = ("auto", "python", "numpy", "torch")


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
    p.add_argument("file", metavar="FILE", help="input file, or - for standard input (then --format is needed)")
    p.add_argument("--format", choices=io.FORMATS, help=f"input format (default: from the extension; {formats})")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write the result to OUT atomically (.parquet writes Parquet, .csv CSV, anything else JSON) "
                        "instead of stdout")
    p.add_argument("--nonfinite", choices=("propagate", "raise"), default="propagate",
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
    _add_input_options(p, "JSON array of rows, JSON Lines of arrays or objects, CSV with a header, Parquet "
                          "columns shard_id, worker_id, owner_id, gradient")
    p.set_defaults(handler=_run_owner_sum)


def _add_mean(sub: Any) -> None:
    p = sub.add_parser("mean", help="mean of each parameter over all microbatches, absent counting as zero",
                       description="M microbatches of P values (null/empty = absent): print the P means "
                                   "sum/M as JSON. Activity counters are accepted and never used as the divisor.")
    _add_input_options(p, 'JSON {"rows": ..., "active_counts": ...} or array, JSON Lines, CSV; Parquet: one '
                          "column per microbatch, one row per parameter, null = absent")
    p.set_defaults(handler=_run_mean)


def _add_verify(sub: Any) -> None:
    p = sub.add_parser("verify", help="run the contract checks and print the observations as JSON",
                       description="Run the contract checks against the built-in implementation or a function of "
                                   "yours; exit 0 if every check passes, 1 otherwise.")
    p.add_argument("--contract", choices=(*CONTRACTS, "all"), default="all", help="which contract (default: all)")
    p.add_argument("--impl", metavar="MODULE:FUNCTION",
                   help="check this function instead of the built-in one (needs --contract owner-sum or "
                        "microbatch-mean); e.g. gradagg.mutants:first_replica")
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
    fmt = io.detect_format(args.file, args.format)
    with progress_for(quiet=args.quiet, stream=sys.stderr) as progress:
        if fmt == "parquet":
            shards, totals = _parquet().owner_sum_file(args.file, engine=args.engine, nonfinite=args.nonfinite,
                                                       progress=progress)
        else:
            rows = io.read_owner_rows(io.read_text(args.file), fmt, source=_source(args.file))
            shards, totals = _owner_sum_rows(rows, args.engine, args.nonfinite)
    if _is_parquet(args.output):
        _parquet().write_owner_sum(args.output, shards, totals)
    else:
        # Tuples, not lists: json writes them alike, and a million small lists cost a second to build.
        _emit(list(zip(_tolist(shards), _tolist(totals))), args.output, "owner-sum")
    return EXIT_OK


def _owner_sum_rows(rows: list[Any], engine: str, nonfinite: NonFinite) -> tuple[Any, Any]:
    """Owner-sum over parsed rows: the reference for python/auto, else the columnar engine."""
    if engine in ("auto", "python"):
        result = owner_sum(rows, nonfinite=nonfinite)
        return [s for s, _ in result], [t for _, t in result]
    from gradagg.engine import owner_sum_columns

    return owner_sum_columns(*io.owner_columns(rows), engine=engine, nonfinite=nonfinite)


def _run_mean(args: argparse.Namespace) -> int:
    fmt = io.detect_format(args.file, args.format)
    with progress_for(quiet=args.quiet, stream=sys.stderr) as progress:
        if fmt == "parquet":
            means = _parquet().microbatch_mean_file(args.file, engine=args.engine, nonfinite=args.nonfinite,
                                                    progress=progress)
        else:
            rows, counts = io.read_microbatches(io.read_text(args.file), fmt, source=_source(args.file))
            means = _mean_rows(rows, counts, args.engine, args.nonfinite)
    if _is_parquet(args.output):
        _parquet().write_mean(args.output, means)
    else:
        _emit([float(x) for x in _tolist(means)], args.output, "microbatch-mean")
    return EXIT_OK


def _mean_rows(rows: list[Any], counts: list[Any] | None, engine: str, nonfinite: NonFinite) -> Any:
    """The microbatch mean over parsed rows: the reference for python/auto, else the columnar engine."""
    if engine in ("auto", "python"):
        return microbatch_mean(rows, counts, nonfinite=nonfinite)
    microbatch_mean([], counts)  # the reference's check of the counters (never a divisor) on no rows
    if not rows:
        return []
    from gradagg.engine import microbatch_mean_columns

    return microbatch_mean_columns(rows, engine=engine, nonfinite=nonfinite)


def _run_verify(args: argparse.Namespace) -> int:
    if args.impl is not None and args.contract == "all":
        _fail("--impl checks one contract: add --contract owner-sum or --contract microbatch-mean")
    impl = _load_impl(args.impl) if args.impl else None
    contracts = CONTRACTS if args.contract == "all" else (args.contract,)
    observations: list[dict[str, Any]] = []
    for contract in contracts:
        for obs in run_checks(contract, impl)["observations"]:
            label = obs["check"] if len(contracts) == 1 else f"{contract}: {obs['check']}"
            observations.append({**obs, "check": label})
    passed = all(o["passed"] for o in observations)
    print(json.dumps({"observations": observations, "passed": passed}, ensure_ascii=False))
    return EXIT_OK if passed else EXIT_FAILED


def _load_impl(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        _fail(f"--impl must be MODULE:FUNCTION, got {spec!r}")
    sys.path.insert(0, os.getcwd())  # so a module in the current folder can be named
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        _fail(f"--impl {spec}: cannot import module {module_name!r}: {exc}")
    except AttributeError:
        _fail(f"--impl {spec}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        _fail(f"--impl {spec}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def _source(path: str) -> str:
    return "<stdin>" if path == "-" else path


def _is_parquet(output: str | None) -> bool:
    return output is not None and output.lower().endswith(".parquet")


def _tolist(values: Any) -> list[Any]:
    """Plain Python numbers and strings from a NumPy array, a torch tensor or a list (for JSON and CSV)."""
    if hasattr(values, "detach"):
        values = values.detach().cpu()
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _parquet() -> Any:
    """:mod:`gradagg.formats.parquet`, imported only when a Parquet file is read or written (pyarrow, numpy)."""
    try:
        return importlib.import_module("gradagg.formats.parquet")
    except ImportError as exc:
        _fail(f"Parquet needs pyarrow and numpy ({exc}); install them with: pip install 'gradagg[parquet]'")


def _emit(result: Any, output: str | None, contract: str) -> None:
    if output is None:
        print(io.dumps_result(result))
        return
    is_csv = output.lower().endswith(".csv")
    write_atomic(output, io.result_to_csv(result, contract) if is_csv else io.dumps_result(result) + "\n")


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
    gradagg``), the process is short-lived, so numba is kept out of it; see
    :func:`_keep_numba_out`. Called with an ``argv`` list, nothing global changes.
    """
    args = build_parser().parse_args(argv)
    if argv is None and args.command in ("owner-sum", "mean"):
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
    except UnicodeDecodeError as exc:
        _fail(f"{_source(args.file)}: not UTF-8 text ({exc.reason} at byte {exc.start})")
    except KeyboardInterrupt:
        print("gradagg: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
