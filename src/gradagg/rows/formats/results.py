"""A result written where the command line sends it, in the format that destination names.

Standard output gets JSON. ``-o OUT`` gets the format of its extension
(:func:`output_format`: ``.parquet``, ``.csv``, ``.jsonl`` or ``.ndjson``,
anything else JSON), written atomically (:mod:`gradagg.rows.formats.atomic`).
A failure to write names the output: the file, or standard output.

JSON and JSON Lines text is Python's ``json.dumps`` of the plain values, except
for the engines' NumPy columns of finite numbers where orjson is installed
(:func:`orjson_text`): its text reads back as the same values, bit for bit, but
is compact (``[[1,0.5]]``) and may spell a float otherwise (``1e-7`` for
``1e-07``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from gradagg.errors import GradaggError, OutputError, short_repr
from gradagg.rows.formats import parquet_module
from gradagg.rows.formats.atomic import write_atomic
from gradagg.rows.formats.detect import OUTPUT_FORMATS

STDOUT = "standard output"


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
            parquet_module(OutputError, "writing").write_owner_sum(path, shards, totals)
        else:
            content = orjson_text(fmt, shards, totals)
            if content is None:
                content = result_text(Columns(_plain(shards), _plain(totals)), "owner-sum", fmt)
            _write_text(path, fmt, content)


def write_mean(path: str | None, means: Any) -> None:
    """Write the P means to ``path``, or to standard output when it is None (see :func:`write_owner_sum`)."""
    fmt = output_format(path)
    with _named(path):
        if fmt == "parquet":
            parquet_module(OutputError, "writing").write_mean(path, means)
        else:
            content = orjson_text(fmt, means)
            _write_text(path, fmt, result_text(_plain(means), "microbatch-mean", fmt) if content is None else content)


def orjson_text(fmt: str, *columns: Any) -> str | None:
    """The JSON or JSON Lines text of NumPy columns of finite numbers, written by orjson; None where it cannot be.

    Python's json spends most of a large result's time in ``float.__repr__``, one
    call per total; orjson writes, in C, the shortest text that reads back as
    the same float64. Only what it writes with the same meaning as json is
    given to it: integer and float arrays without NaN or infinity (orjson
    writes those as null). Strings (json escapes them to ASCII), lists, tensors
    and a result holding NaN go to json.

    Args:
        fmt: the output format (``json`` or ``jsonl``; anything else gets None).
        columns: one column (the means) or two (shards, totals), zipped into pairs as json's are.

    Returns:
        The text, ending in a newline (JSON Lines: one per element), or None: orjson is not installed,
        or the columns are not such arrays.
    """
    if fmt not in ("json", "jsonl") or not all(map(_finite_numbers, columns)):
        return None
    try:
        import orjson
    except ImportError:
        return None
    items = columns[0].tolist() if len(columns) == 1 else list(zip(*(c.tolist() for c in columns)))
    text: bytes = orjson.dumps(items) if fmt == "json" else b"\n".join(map(orjson.dumps, items))
    return text.decode("ascii") + "\n" if text else ""


def _finite_numbers(column: Any) -> bool:
    """A NumPy array of integers, or of floats none of which is NaN or infinite (torch dtypes have no ``kind``)."""
    kind = getattr(getattr(column, "dtype", None), "kind", None)
    if type(column).__module__ != "numpy" or kind not in ("i", "u", "f"):
        return False
    if kind != "f":
        return True
    import numpy as np  # (a NumPy array is here: numpy is loaded)

    return bool(np.isfinite(column).all())


def _plain(column: Any) -> list[Any]:
    """Plain Python values of a NumPy array or torch tensor (any device), as the text writers want."""
    return column.tolist() if hasattr(column, "tolist") else list(column)  # type: ignore[no-any-return]


def _write_text(path: str | None, fmt: str, content: str) -> None:
    if path is not None:
        data = encode_csv(content, path) if fmt == "csv" else content.encode("ascii")
        write_atomic(path, data)
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
        what = "" if message.startswith("cannot write") else "cannot write the result: "
        raise OutputError(f"{where}: {what}{message}") from None


# --- text ------------------------------------------------------------------------------


class Columns(NamedTuple):
    """An owner-sum result as its two columns of plain Python values, written as the pairs ``zip(shards, totals)``.

    The columns are zipped only as they are written, so no list per pair is made.
    """

    shards: Sequence[Any]
    totals: Sequence[Any]


def result_text(result: Any, contract: str, fmt: str) -> str:
    """A result as the text of ``fmt``: ``json`` (one line), ``jsonl`` (one element a line) or ``csv``.

    Args:
        result: a list of means, or of ``[shard, total]`` pairs, or :class:`Columns`.
        contract: ``owner-sum`` or ``microbatch-mean`` (the CSV header).
        fmt: the output format.

    Returns:
        The text, ending in a newline.

    Raises:
        OutputError: an integer with more digits than Python writes as text.

    >>> print(result_text(Columns(["x", "y"], [1, 2.5]), "owner-sum", "jsonl"), end="")
    ["x", 1]
    ["y", 2.5]
    """
    if fmt == "csv":
        return result_to_csv(result, contract)
    if fmt == "jsonl":
        pairs = list(zip(*result)) if isinstance(result, Columns) else result
        try:
            return "".join(json.dumps(item) + "\n" for item in pairs)
        except ValueError:
            raise _unwritable(pairs) from None
    return dumps_result(result) + "\n"


def dumps_result(result: Any) -> str:
    """The JSON text of a result (NaN and Infinity written as Python's json does; ASCII only).

    Args:
        result: a list of values or of ``[shard, total]`` pairs, or :class:`Columns`.

    Returns:
        ``json.dumps`` of the result (of ``list(zip(shards, totals))`` for columns).

    Raises:
        OutputError: an integer with more digits than Python writes as text.

    >>> dumps_result([["x", 1], ["y", 2]])
    '[["x", 1], ["y", 2]]'
    >>> dumps_result(Columns([3, 7], [-0.0, float("nan")]))
    '[[3, -0.0], [7, NaN]]'
    """
    if isinstance(result, Columns):
        result = list(zip(*result))  # tuples, not lists: json writes them alike, and a tuple is cheaper to make
    try:
        return json.dumps(result)
    except ValueError:
        raise _unwritable(result) from None


def result_to_csv(result: Any, contract: str) -> str:
    """A result as CSV: ``shard_id,total`` rows, or ``parameter,mean`` rows.

    A cell is quoted when it holds a comma, a quote, a line break or
    surrounding spaces (the csv module would leave a lone carriage return
    unquoted); a vector total is a JSON array cell. An owner-sum result may
    be :class:`Columns`, written as its pairs are.

    >>> print(result_to_csv([["x", 1], ["a,b", [1.5, 2]]], "owner-sum"), end="")
    shard_id,total
    x,1
    "a,b","[1.5, 2]"
    """
    if isinstance(result, Columns):
        result = list(zip(*result))
    try:
        if contract == "owner-sum":
            lines = ["shard_id,total"] + [f"{_cell(s)},{_cell(t)}" for s, t in result]
        else:
            lines = ["parameter,mean"] + [f"{j},{_cell(m)}" for j, m in enumerate(result)]
    except ValueError:
        raise _unwritable(result) from None
    return "\n".join(lines) + "\n"


def encode_csv(text: str, target: str = "output") -> bytes:
    """The UTF-8 bytes of a CSV result; a lone surrogate (which JSON input can hold, UTF-8 cannot) is an error.

    >>> encode_csv("shard_id,total\\nü,1\\n", "out.csv")
    b'shard_id,total\\n\\xc3\\xbc,1\\n'
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        line = text.count("\n", 0, exc.start) + 1
        raise OutputError(
            f"{target}: cannot write CSV: line {line} holds the lone surrogate U+{ord(text[exc.start]):04X} (from a "
            f"JSON escape such as \\ud800), which UTF-8 cannot encode; write JSON instead (-o FILE.json)"
        ) from None


def _unwritable(result: Any) -> OutputError:
    """The error for a result that holds an integer too long for Python to write as text."""
    limit = sys.get_int_max_str_digits()
    for shard, total in result:
        for x in total if isinstance(total, list) else [total]:
            if isinstance(x, int) and x.bit_length() * 0.30103 > limit - 1:
                return OutputError(f"cannot write the result as text: the total of shard {short_repr(shard)} is an "
                                   f"integer of about {int(x.bit_length() * 0.30103) + 1} digits, over Python's "
                                   f"limit of {limit} digits for writing one")
    return OutputError("cannot write the result as text")


def _cell(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, list) else value if isinstance(value, str) else repr(value)
    if text == "" or text != text.strip() or any(c in text for c in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text
