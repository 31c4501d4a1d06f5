"""A result written where the command line sends it, in the format that destination names.

Standard output gets JSON. ``-o OUT`` gets the format of its extension
(:func:`output_format`: ``.parquet``, ``.csv``, ``.jsonl`` or ``.ndjson``,
anything else JSON), written atomically (:mod:`gradagg.formats.atomic`).
A failure to write names the output: the file, or standard output.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from gradagg.errors import GradaggError, OutputError
from gradagg.formats import text
from gradagg.formats.atomic import check_target, write_atomic
from gradagg.formats.detect import OUTPUT_FORMATS

STDOUT = "standard output"


def check_destination(path: str | None) -> None:
    """Refuse, before any work, an output that cannot be written: a directory, a missing folder, closed stdout.

    >>> check_destination("/dev/null")
    """
    if path is not None:
        check_target(path)
    elif sys.stdout is None:
        raise OutputError(f"{STDOUT} is closed; pass -o OUT to write the result to a file")


def output_format(path: str | None) -> str:
    """The format a result is written in to ``path`` (None: standard output): the one its extension names, else JSON.

    >>> output_format("out.jsonl"), output_format("OUT.Parquet"), output_format("/dev/stdout"), output_format(None)
    ('jsonl', 'parquet', 'json', 'json')
    """
    return "json" if path is None else OUTPUT_FORMATS.get(os.path.splitext(path)[1].lower(), "json")


def write_owner_sum(path: str | None, shards: Any, totals: Any) -> None:
    """Write an owner-sum result (its two columns) to ``path``, or to standard output when it is None.

    Args:
        path: the ``-o`` file, or None.
        shards: the S shard ids (a list, or an array with ``tolist``).
        totals: their S totals.

    Raises:
        OutputError: the result cannot be written there, naming the output and why.
    """
    fmt = output_format(path)
    with _named(path):
        if fmt == "parquet":
            _parquet().write_owner_sum(path, shards, totals)
        else:
            _write_text(path, fmt, text.result_text(text.Columns(_plain(shards), _plain(totals)), "owner-sum", fmt))


def write_mean(path: str | None, means: Any) -> None:
    """Write the P means to ``path``, or to standard output when it is None (see :func:`write_owner_sum`)."""
    fmt = output_format(path)
    with _named(path):
        if fmt == "parquet":
            _parquet().write_mean(path, means)
        else:
            _write_text(path, fmt, text.result_text(_plain(means), "microbatch-mean", fmt))


def _plain(column: Any) -> list[Any]:
    """Plain Python values of a NumPy array or torch tensor (any device), as the text writers want."""
    return column.tolist() if hasattr(column, "tolist") else list(column)  # type: ignore[no-any-return]


def _write_text(path: str | None, fmt: str, content: str) -> None:
    if path is not None:
        write_atomic(path, text.encode_csv(content, path) if fmt == "csv" else content.encode("ascii"))
    else:
        sys.stdout.write(content)
        sys.stdout.flush()  # here, not at exit: a full disk or a closed pipe is reported by this command


@contextlib.contextmanager
def _named(path: str | None) -> Iterator[None]:
    """Every failure to write, named after the output (pyarrow's and the OS's errors name no file)."""
    where = STDOUT if path is None else path
    try:
        yield
    except BrokenPipeError:
        raise  # the reader left (`| head`): not an error of this command
    except (OSError, GradaggError) as exc:
        message = str(exc.strerror or exc) if isinstance(exc, OSError) else str(exc)
        if message.startswith(f"{where}: "):
            raise
        raise OutputError(f"{where}: cannot write the result: {message}") from None


def _parquet() -> Any:
    """:mod:`gradagg.formats.parquet`, imported only when a Parquet file is written (pyarrow, numpy)."""
    try:
        return importlib.import_module("gradagg.formats.parquet")
    except ImportError as exc:
        raise OutputError(f"writing Parquet needs pyarrow and numpy ({exc}); install them with: "
                          "pip install 'gradagg[parquet]'") from None
