"""JSON, JSON Lines and CSV: text into rows, results into text. Read and write only.

Readers turn text into the plain Python rows of :mod:`gradagg.reference` and
nothing else: they check the *text* (a parse error names the line), never the
contract (ids, gradient types, lengths: the reference checks those and names
the row). Rows are numbered from 0 in file order, not counting a CSV header.

Owner-sum inputs, one row per ``(shard_id, worker_id, owner_id, gradient)``:

* ``.json``  a JSON array of 4-element arrays (the case documents' form);
* ``.jsonl`` one row a line: a 4-element array, or an object with exactly the
  keys ``shard_id, worker_id, owner_id, gradient``;
* ``.csv``   header ``shard_id,worker_id,owner_id,gradient``. An id cell that is
  a canonical integer (``7``, ``-3``; not ``007``, ``-0`` or ``+7``) becomes an
  int, any other cell stays a string, compared exactly (so a space before or
  after an id is an error, not silently part of it); an empty id cell is a
  missing id. A gradient cell is a number or a JSON array (``"[1, 2.5]"``).

Microbatch-mean inputs, M microbatches of P values, absent written as null:

* ``.json``  ``{"rows": [...], "active_counts": [...]}`` or a bare array of rows;
* ``.jsonl`` one microbatch a line, a JSON array;
* ``.csv``   one microbatch a line, an empty cell meaning absent. The first line
  is a header of parameter names when every cell is a name (not a number, not
  empty), a microbatch when every cell is a number or empty; anything else is
  an error naming the line, settled by ``header=True`` / ``False``.

Rules that hold in every format:

* No line is ever skipped. A blank line in CSV is one empty cell, as in
  RFC 4180: an absent value in a one-column mean file, and an error (wrong
  number of cells) anywhere else. A blank line in JSON Lines is an error.
* Numbers: a CSV number is ASCII decimal (``1``, ``-2.5``, ``1e-3``, ``.5``)
  or ``nan``/``inf``/``infinity`` with an optional sign, any case; integer
  literals are exact ints. A number too large for a float (``1e400``) is an
  error, not Infinity; an integer of more digits than Python converts
  (``sys.get_int_max_str_digits()``, 4300) is an error. Underflow
  (``1e-400``) rounds to 0.0 as in every float parser.
* A JSON object with a repeated key is an error (only one value could count).
* Text is UTF-8 (a leading byte-order mark is allowed); an empty input (0
  bytes) is an error: an input with no rows is ``[]`` in JSON or a header line
  in CSV, so an empty file is never mistaken for one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from gradagg.errors import FormatError, OutputError, short_repr
from gradagg.formats import _csv, _json
from gradagg.formats._json import OWNER_FIELDS

__all__ = ["OWNER_FIELDS", "Columns", "check_header", "dumps_result", "encode_csv", "read_microbatches",
           "read_owner_rows", "result_text", "result_to_csv"]


# --- owner-sum rows ------------------------------------------------------------


def read_owner_rows(text: str, fmt: str, source: str = "input") -> list[Any]:
    """Owner-sum rows from ``text`` in format ``fmt`` (``json``, ``jsonl`` or ``csv``).

    Args:
        text: the whole input.
        fmt: its format.
        source: the input's name for messages.

    Returns:
        The rows, as the file holds them (checked by the reference, not here).

    Raises:
        FormatError: text that is not valid in ``fmt``, naming the line.

    >>> read_owner_rows("shard_id,worker_id,owner_id,gradient\\nx,0,0,1.5\\n", "csv")
    [['x', 0, 0, 1.5]]
    """
    if fmt in ("json", "jsonl"):
        return _json.owner_rows(text, fmt, source)
    if fmt == "csv":
        return _csv.owner_rows(text, source)
    raise FormatError(f"{source}: format {fmt!r} is not a text format")


# --- microbatch rows -----------------------------------------------------------


def read_microbatches(
    text: str, fmt: str, source: str = "input", *, header: bool | None = None
) -> tuple[list[Any], Any]:
    """``(rows, active_counts)`` for the microbatch mean from ``text`` in format ``fmt``.

    Args:
        text: the whole input.
        fmt: ``json``, ``jsonl`` or ``csv``.
        source: the input's name for messages.
        header: CSV only: ``True`` the first line is a header (skipped),
            ``False`` it is a microbatch, ``None`` decide by the rule in the
            module docstring (an ambiguous first line is an error).

    Returns:
        The microbatches as the file holds them, and the active counts
        (``None`` unless a JSON object gives them).

    Raises:
        FormatError: text that is not valid in ``fmt``, naming the line.

    >>> read_microbatches('{"rows": [[2, null], [4, 6]], "active_counts": [1, 2]}', "json")
    ([[2, None], [4, 6]], [1, 2])
    >>> read_microbatches("a,b\\n2,\\n4,6\\n", "csv")
    ([[2, None], [4, 6]], None)
    """
    check_header(header, fmt, source)
    if fmt in ("json", "jsonl"):
        return _json.microbatches(text, fmt, source)
    if fmt == "csv":
        return _csv.microbatches(text, source, header), None
    raise FormatError(f"{source}: format {fmt!r} is not a text format")


def check_header(header: bool | None, fmt: str, source: str) -> None:
    """Refuse a header choice for a format that has no header line (anything but CSV).

    >>> check_header(None, "parquet", "m.parquet")
    """
    if header is not None and fmt != "csv":
        raise FormatError(f"{source}: --header and --no-header apply to CSV input only, not {fmt}")


# --- writing -----------------------------------------------------------------------


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
        result = list(zip(*result))  # tuples, not lists: json writes them alike, and 10^6 small lists cost a second
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
