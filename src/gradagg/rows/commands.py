"""The file commands: ``owner-sum`` and ``mean`` read, apply the contract, write.

Reached through :mod:`gradagg.cli` (the parser, the exit statuses), which runs
them only where the ``rows`` extra is installed.

Each reads its input once (:func:`gradagg.rows.formats.detect.read_input`), hands
the rows or Parquet batches to :mod:`gradagg.rows.engine` (``owner-sum`` feeds an
accumulator, chosen before the input is read), and writes the result
(:mod:`gradagg.rows.formats.results`). An error in the input names the file
(:func:`gradagg.rows.formats.detect.named_errors`).
"""

from __future__ import annotations

import argparse
import sys

from gradagg.errors import FormatError, GradaggError, OutputError
from gradagg.options import CONTRACTS, install_hint
from gradagg.rows.formats import detect, parquet_module, results, text
from gradagg.rows.formats.atomic import check_target
from gradagg.rows.progress import progress_for

EXIT_OK = 0
OWNER_SUM, MEAN = CONTRACTS


def owner_sum(args: argparse.Namespace) -> int:
    """``gradagg owner-sum``: each shard's total over its owner's rows, sorted by shard."""
    from gradagg.rows import engine

    batch_engine = _file_engine(args.engine)
    totals_of = engine.ColumnarOwnerSum(engine=batch_engine, nonfinite=args.nonfinite)  # the contract, chosen
    source = _read(args, OWNER_SUM)
    with detect.named_errors(source, OWNER_SUM), progress_for(quiet=args.quiet, stream=sys.stderr) as progress:
        if source.fmt == "parquet":
            for batch in parquet_module(FormatError, "reading").owner_batches(source.parquet, progress=progress):
                totals_of.update(*batch)
            shards, totals = totals_of.result()
        else:
            rows = text.read_owner_rows(source.text, source.fmt, source.name)
            pairs = engine.owner_sum_rows(rows, engine=args.engine, nonfinite=args.nonfinite)
            shards, totals = [s for s, _ in pairs], [t for _, t in pairs]
    results.write_owner_sum(args.output, shards, totals)
    return EXIT_OK


def mean(args: argparse.Namespace) -> int:
    """``gradagg mean``: each parameter's sum over the M microbatches, divided by M."""
    from gradagg.rows import engine

    source = _read(args, MEAN)
    with detect.named_errors(source, MEAN), progress_for(quiet=args.quiet, stream=sys.stderr) as progress:
        if source.fmt == "parquet":
            text.check_header(args.header, source.fmt, source.name)  # (the text readers check it themselves)
            batches = parquet_module(FormatError, "reading").microbatch_batches(source.parquet, progress=progress)
            means = engine.microbatch_mean_batches(batches, engine=_file_engine(args.engine), nonfinite=args.nonfinite)
        else:
            rows, counts = text.read_microbatches(source.text, source.fmt, source.name, header=args.header)
            means = engine.microbatch_mean_rows(rows, counts, engine=args.engine, nonfinite=args.nonfinite)
    results.write_mean(args.output, means)
    return EXIT_OK


def _read(args: argparse.Namespace, contract: str) -> detect.Input:
    """Check the engine and ``-o`` (before any work), find the input's format and read what is read whole."""
    _check_engine(args.engine)
    if args.output is not None:
        check_target(args.output)
    elif sys.stdout is None:
        raise OutputError("standard output is closed; pass -o OUT to write the result to a file")
    return detect.read_input(args.file, args.format, contract, getattr(sys.stdin, "buffer", None))


def _file_engine(name: str) -> str:
    """The engine for a Parquet file's batches: ``--engine auto`` is numpy here, resolved by the command.

    One run over one file does not pay numba's import and kernel loading (the
    library's ``"auto"`` would pick numba for NumPy batches); ``--engine numba``
    still asks for it. Without NumPy, ``auto`` stays ``auto`` (the engine's
    own fallback).
    """
    from gradagg.rows.engine import available_engines

    return "numpy" if name == "auto" and "numpy" in available_engines() else name


def _check_engine(name: str) -> None:
    from gradagg.rows.engine import available_engines

    if name != "auto" and name not in available_engines():
        extra = {"numba": "jit", "numpy": "rows"}.get(name, name)
        raise GradaggError(f"--engine {name} needs {name}, which is not installed here; install it with: "
                           f"{install_hint(extra)} (or use --engine auto or python)")
