"""The options of every subcommand; ``gradagg --help`` and each subcommand's ``--help`` come from here.

Parsing imports nothing heavy: the handlers of ``owner-sum``, ``mean`` and
``verify`` are in :mod:`gradagg.rows.commands` (which imports the engine only
when a command runs); ``demo`` and ``parity`` bring their own options, imported
only when that subcommand is named.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from gradagg.cli import commands
from gradagg.cli.signals import EXIT_USAGE, fail
from gradagg.options import CONTRACTS, ENGINES, EXTENSIONS, FORMATS, NONFINITE


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: {message}" if " " in self.prog else message)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed command line (``argv`` None: the process's); no arguments at all print the commands, exit 2."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        raise SystemExit(EXIT_USAGE)
    return parser.parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = _Parser(prog="gradagg", description="Exactly-once gradient aggregation: declared, checked, visible.")
    parser.add_argument("--version", action="version", version=f"gradagg {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_owner_sum(sub)
    _add_mean(sub)
    _add_verify(sub)
    _add_lazy(sub, "demo", "gradagg.demo", "train a small model on 2 local processes and compare with the full batch",
              "The main job: distributed training with gradagg against the single-process full-batch gradient "
              "and the known wrong approaches.")
    _add_lazy(sub, "parity", "gradagg.parity",
              "check your own distributed training step against the one-process full batch",
              "Run SCRIPT.py's step() on local gloo worlds of several microbatch layouts and compare every "
              "gradient with the full-batch one; print the observations as JSON; exit 0 if every layout matches, "
              "1 otherwise. With --sweep, a grid of world sizes and microbatches per rank, and a table of the "
              "factor by which each cell's gradient is off (or 'exact').")
    return parser


def _add_input_options(p: argparse.ArgumentParser, formats: str) -> None:
    p.add_argument("file", metavar="FILE",
                   help="input file, or - for standard input: without --format its content tells the format "
                        "(Parquet by its magic bytes; text starting with [ or { is JSON or JSON Lines: several "
                        "lines whose first is a whole JSON value are JSON Lines; anything else is CSV). Standard "
                        "input, a FIFO or a device is read once into memory, up to half the memory allowed")
    p.add_argument("--format", choices=FORMATS, help=f"input format (default: from the extension; {formats})")
    p.add_argument("-o", "--output", metavar="OUT",
                   help=f"write the result to OUT atomically ({_output_formats()}, anything else JSON) "
                        "instead of stdout; a symbolic link's target is replaced and the link kept; a FIFO or "
                        "character device (/dev/null) is written in place; a directory is refused")
    p.add_argument("--nonfinite", choices=NONFINITE, default="propagate",
                   help="NaN/Inf in a counted gradient: let it flow into the result (default) or fail")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default): the streaming numpy engine for Parquet, the pure-Python reference for "
                        "JSON/JSONL/CSV (there parsing the text dominates); python: the reference (reads the whole "
                        "file into memory); numpy: pure NumPy; numba: NumPy with fused numba kernels (compiled on "
                        "first use, so auto never picks it for one file); torch: the torch engine")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress line (one is drawn on stderr for long Parquet inputs, only on a terminal)")


def _output_formats() -> str:
    names = {"json": "JSON", "jsonl": "JSON Lines", "csv": "CSV", "parquet": "Parquet"}
    by_format: dict[str, list[str]] = {}
    for ext, fmt in EXTENSIONS.items():
        by_format.setdefault(fmt, []).append(ext)
    return ", ".join(f"{' or '.join(exts)} writes {names[fmt]}" for fmt, exts in by_format.items())


def _add_owner_sum(sub: Any) -> None:
    p = sub.add_parser("owner-sum", help="sum each shard's gradient over its owner's rows only",
                       description="Rows [shard_id, worker_id, owner_id, gradient]: sum the rows where worker equals "
                                   "owner, grouped by shard; print sorted [[shard, total], ...] as JSON.")
    _add_input_options(p, "JSON array of rows, JSON Lines of arrays or objects, CSV with the header "
                          "shard_id,worker_id,owner_id,gradient, Parquet columns of those names")
    p.set_defaults(handler=commands.owner_sum, header=None)


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
    p.set_defaults(handler=commands.mean)


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
    p.set_defaults(handler=commands.verify)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def _add_lazy(sub: Any, name: str, module: str, summary: str, description: str) -> None:
    """A subcommand whose options and handler come from ``module`` (``add_arguments``, ``run``) when it parses."""
    parser = sub.add_parser(name, help=summary, description=description)
    parser.__class__ = _LazyParser  # add_parser takes no parser class before Python 3.13; same fields, one more method
    parser.set_defaults(lazy_module=module)


class _LazyParser(_Parser):
    """A subcommand's parser that imports its module only when that subcommand is parsed.

    ``gradagg owner-sum`` then never pays for importing the demo or the parity
    checker: argparse asks a subcommand's parser to parse only when that
    subcommand was named.
    """

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.get_default("handler") is None:
            module = importlib.import_module(self.get_default("lazy_module"))  # light: torch loads when it runs
            module.add_arguments(self)
            self.set_defaults(handler=module.run)
        return super().parse_known_args(args, namespace)


def _version() -> str:
    from gradagg import __version__

    return __version__
