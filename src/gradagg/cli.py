"""The ``gradagg`` command line: parse, read, call, write; nothing else.

Exit status: 0 success, 1 verification failed (``verify``, ``demo``), 2 usage
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

from gradagg import io
from gradagg.errors import GradaggError
from gradagg.reference import microbatch_mean, owner_sum
from gradagg.verify import CONTRACTS, run_checks

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
    return parser


def _add_input_options(p: argparse.ArgumentParser, formats: str) -> None:
    p.add_argument("file", metavar="FILE", help="input file, or - for standard input (then --format is needed)")
    p.add_argument("--format", choices=io.FORMATS, help=f"input format (default: from the extension; {formats})")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write the result to OUT atomically (.csv writes CSV, anything else JSON) instead of stdout")
    p.add_argument("--nonfinite", choices=("propagate", "raise"), default="propagate",
                   help="NaN/Inf in a counted gradient: let it flow into the result (default) or fail")


def _add_owner_sum(sub: Any) -> None:
    p = sub.add_parser("owner-sum", help="sum each shard's gradient over its owner's rows only",
                       description="Rows [shard_id, worker_id, owner_id, gradient]: sum the rows where worker equals "
                                   "owner, grouped by shard; print sorted [[shard, total], ...] as JSON.")
    _add_input_options(p, "JSON array of rows, JSON Lines of arrays or objects, CSV with a header")
    p.set_defaults(handler=_run_owner_sum)


def _add_mean(sub: Any) -> None:
    p = sub.add_parser("mean", help="mean of each parameter over all microbatches, absent counting as zero",
                       description="M microbatches of P values (null/empty = absent): print the P means "
                                   "sum/M as JSON. Activity counters are accepted and never used as the divisor.")
    _add_input_options(p, 'JSON {"rows": ..., "active_counts": ...} or array, JSON Lines, CSV')
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
    from gradagg import demo  # light at import: torch is loaded only when the demo runs

    demo.add_arguments(p)
    p.set_defaults(handler=demo.run)


# --- handlers --------------------------------------------------------------------


def _run_owner_sum(args: argparse.Namespace) -> int:
    fmt = io.detect_format(args.file, args.format)
    rows = io.read_owner_rows(io.read_text(args.file), fmt, source=_source(args.file))
    _emit(owner_sum(rows, nonfinite=args.nonfinite), args.output, "owner-sum")
    return EXIT_OK


def _run_mean(args: argparse.Namespace) -> int:
    fmt = io.detect_format(args.file, args.format)
    rows, counts = io.read_microbatches(io.read_text(args.file), fmt, source=_source(args.file))
    _emit(microbatch_mean(rows, counts, nonfinite=args.nonfinite), args.output, "microbatch-mean")
    return EXIT_OK


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


def _emit(result: Any, output: str | None, contract: str) -> None:
    if output is None:
        print(io.dumps_result(result))
        return
    is_csv = output.lower().endswith(".csv")
    io.write_atomic(output, io.result_to_csv(result, contract) if is_csv else io.dumps_result(result) + "\n")


def _version() -> str:
    from gradagg import __version__

    return __version__


# --- entry point -----------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except GradaggError as exc:
        _fail(str(exc))
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
