"""The command line of ``gradagg parity``: its options and its run (JSON on stdout, a summary on a terminal)."""

from __future__ import annotations

import argparse
import json
import sys

from gradagg.errors import GradaggError
from gradagg.parity.check import check_parity
from gradagg.parity.layouts import MAX_RANKS, parse_layout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``gradagg parity SCRIPT.py [--layouts L [L ...]] [--rtol R]`` and of its ``--sweep``
    (``--worlds``, ``--per-rank``, ``--json``) to ``parser``."""
    parser.add_argument("script", metavar="SCRIPT.py",
                        help="defines build_model(), microbatches(), full_batch_loss(model, microbatches), "
                             "step(model, microbatches) and optionally prepare(model)")
    parser.add_argument("--layouts", nargs="+", metavar="L",
                        help="microbatches per rank, e.g. 8 4,4 1,7 0,8; each must sum to the window (default: one "
                             f"process, an even and an uneven split on 2 ranks); at most {MAX_RANKS} ranks")
    parser.add_argument("--sweep", action="store_true",
                        help="run the step on a grid of world sizes and microbatches per rank (even and uneven) and "
                             "print, per cell, 'exact' or the factor its gradient is off the one-process full batch; "
                             "microbatches(n) may take the number of microbatches to split the same rows into")
    parser.add_argument("--worlds", metavar="W,W", help="with --sweep: world sizes (default 1,2,3)")
    parser.add_argument("--per-rank", metavar="K,K", help="with --sweep: microbatches per rank (default 1,2,4)")
    parser.add_argument("--json", metavar="FILE", help="with --sweep: also write the observations as JSON to FILE "
                                                       "('-': to stdout, instead of the table)")
    parser.add_argument("--rtol", type=float, metavar="R",
                        help="largest relative error that passes, per parameter: ||g - t|| / max(||t||, 1%% of the "
                             "whole gradient's norm) (default: by the lowest precision the full batch, or the step "
                             "under torch.autocast, computes in: 1e-9 for float64, 1e-3 for float32, 5e-2 for "
                             "bfloat16 and float16; a float64 model whose loss casts to float32 gets 1e-3)")


def run(args: argparse.Namespace) -> int:
    """Run ``gradagg parity``: the observations as JSON on stdout, a summary on stderr when it is a terminal;
    with ``--sweep``, the table on stdout (``--json FILE`` for the observations).

    Returns:
        0 when every layout (every cell of a sweep) passed, 1 otherwise.

    Raises:
        GradaggError: SCRIPT.py cannot be used, or bad options (the command line exits 2 with one line).
    """
    from gradagg.parity.report import summary

    if sys.stdout is None:  # started with stdout closed: the report could go nowhere
        raise GradaggError("standard output is closed, so the report cannot be written; redirect it instead "
                           "(> report.json, or > /dev/null for the exit status alone)")
    if args.sweep:
        return _run_sweep(args)
    given = [o for o, v in (("--worlds", args.worlds), ("--per-rank", args.per_rank), ("--json", args.json)) if v]
    if given:
        raise GradaggError(f"{given[0]} is an option of --sweep; add --sweep, or use --layouts")
    layouts = [parse_layout(text) for text in args.layouts] if args.layouts else None
    report = check_parity(args.script, layouts, args.rtol)
    print(json.dumps(report.json, ensure_ascii=False, allow_nan=False))
    if sys.stderr.isatty():
        print(summary(report), file=sys.stderr)
    return 0 if report.passed else 1


def _run_sweep(args: argparse.Namespace) -> int:
    """``gradagg parity --sweep``: the table on stdout (or the JSON, with ``--json -``); 0 when every cell is exact."""
    from gradagg.parity.sweep import sweep_parity, table

    if args.layouts:
        raise GradaggError("--layouts and --sweep: choose one (--sweep makes its layouts from --worlds and --per-rank)")
    worlds, per_rank = _counts("--worlds", args.worlds), _counts("--per-rank", args.per_rank)
    report = sweep_parity(args.script, worlds, per_rank, args.rtol)
    text = json.dumps(report.json, ensure_ascii=False, allow_nan=False)
    if args.json and args.json != "-":
        try:
            with open(args.json, "w", encoding="utf-8") as out:
                out.write(text + "\n")
        except OSError as exc:
            raise GradaggError(f"--json {args.json}: cannot write it: {exc.strerror or exc}") from None
    print(text if args.json == "-" else table(report))
    return 0 if report.passed else 1


def _counts(option: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise GradaggError(f"{option} {text!r}: expected whole numbers separated by commas, e.g. 1,2,3") from None
    return counts
