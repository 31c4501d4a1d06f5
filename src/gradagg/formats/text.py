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

from gradagg._native import is_table_result, load
from gradagg.errors import FormatError, OutputError, short_repr
from gradagg.formats import _csv
from gradagg.formats._json import json_lines, load_json

OWNER_FIELDS = ("shard_id", "worker_id", "owner_id", "gradient")


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
    if fmt == "json":
        rows = load_json(text, source)
        if not isinstance(rows, list):
            raise FormatError(f"{source}: expected a JSON array of rows, got {type(rows).__name__}")
        return rows
    if fmt == "jsonl":
        return [_owner_row_from_json(value, line, source) for line, value in json_lines(text, source)]
    if fmt == "csv":
        return _owner_rows_from_csv(text, source)
    raise FormatError(f"{source}: format {fmt!r} is not a text format")


def _owner_row_from_json(value: Any, line: int, source: str) -> Any:
    if not isinstance(value, dict):
        return value  # an array row, or garbage that the reference names by row
    if set(value) != set(OWNER_FIELDS):
        missing = sorted(set(OWNER_FIELDS) - set(value))
        extra = sorted(set(value) - set(OWNER_FIELDS))
        raise FormatError(
            f"{source}: line {line}: object keys must be {', '.join(OWNER_FIELDS)}; "
            f"missing {missing}, unexpected {short_repr(extra)}"
        )
    return [value[k] for k in OWNER_FIELDS]


def _owner_rows_from_csv(text: str, source: str) -> list[list[Any]]:
    records = _csv.records(text, source)
    if not records or [h.strip() for h in records[0][1]] != list(OWNER_FIELDS):
        got = ",".join(records[0][1]) if records else "nothing"
        raise FormatError(f"{source}: line 1: CSV header must be {','.join(OWNER_FIELDS)}, got {short_repr(got)}")
    rows = []
    for line, cells in records[1:]:
        if len(cells) != 4:
            what = "a blank line" if cells == [""] else f"{len(cells)}: {short_repr(cells)}"
            raise FormatError(f"{source}: line {line}: expected 4 cells, got {what}")
        ids = [_csv_id(cell, name, line, source) for name, cell in zip(OWNER_FIELDS[:3], cells[:3])]
        rows.append([*ids, _csv_gradient(cells[3], line, source)])
    return rows


def _csv_id(cell: str, name: str, line: int, source: str) -> int | str | None:
    if cell == "":
        return None  # a missing id: the reference reports it with its row
    if cell != cell.strip():
        raise FormatError(f"{source}: line {line}: {name} {short_repr(cell)} has a space before or after it; "
                          "ids are compared exactly, so remove the space")
    if _csv.CANONICAL_INT.fullmatch(cell):
        return _csv.to_int(cell, f"{source}: line {line}: {name}")
    return cell


def _csv_gradient(cell: str, line: int, source: str) -> Any:
    cell = cell.strip()
    if cell.startswith("["):
        return load_json(cell, f"{source}: line {line}: gradient")
    number = _csv.number(cell, f"{source}: line {line}: gradient")
    if number is None:
        raise FormatError(f"{source}: line {line}: gradient must be a number or a JSON array, got {short_repr(cell)}")
    return number


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
    if fmt == "json":
        return _microbatches_from_json(load_json(text, source), source)
    if fmt == "jsonl":
        return [value for _, value in json_lines(text, source)], None
    if fmt == "csv":
        return _microbatches_from_csv(text, source, header), None
    raise FormatError(f"{source}: format {fmt!r} is not a text format")


def check_header(header: bool | None, fmt: str, source: str) -> None:
    """Refuse a header choice for a format that has no header line (anything but CSV).

    >>> check_header(None, "parquet", "m.parquet")
    """
    if header is not None and fmt != "csv":
        raise FormatError(f"{source}: --header and --no-header apply to CSV input only, not {fmt}")


def _microbatches_from_json(data: Any, source: str) -> tuple[list[Any], Any]:
    if isinstance(data, list):
        return data, None
    if not isinstance(data, dict) or "rows" not in data:
        raise FormatError(f'{source}: expected {{"rows": [...], "active_counts": [...]}} or an array of rows')
    extra = sorted(set(data) - {"rows", "active_counts"})
    if extra:
        raise FormatError(f"{source}: unexpected keys {short_repr(extra)}; allowed are rows, active_counts")
    rows = data["rows"]
    if not isinstance(rows, list):
        raise FormatError(f'{source}: "rows" must be an array, got {type(rows).__name__}')
    return rows, data.get("active_counts")


def _microbatches_from_csv(text: str, source: str, header: bool | None) -> list[list[Any]]:
    records = _csv.records(text, source)
    if records and (header or (header is None and _is_header(*records[0], source))):
        width: int | None = len(records[0][1])
        records = records[1:]
    else:
        width = len(records[0][1]) if records else None
    rows = []
    for i, (line, cells) in enumerate(records):
        where = f"{source}: line {line} (microbatch {i})"
        if width is not None and len(cells) != width:
            raise FormatError(f"{where}: {_cells(cells, width)}, expected {width} (from line 1)")
        rows.append([_csv_value(c, f"{where}, parameter {j}") for j, c in enumerate(cells)])
    return rows


def _is_header(line: int, cells: list[str], source: str) -> bool:
    """A header has a name in every cell; a microbatch a number or nothing in every cell; else we cannot tell."""
    names = [c for c in cells if c.strip() and not _csv.is_number(c.strip())]
    if len(names) == len(cells):
        return True
    if not names:
        return False
    values = [c for c in cells if c not in names]
    raise FormatError(
        f"{source}: line {line}: cannot tell a header from a microbatch: {short_repr(names)} are not numbers but "
        f"{short_repr(values)} are numbers or empty; pass --header if line {line} names the parameters, "
        "--no-header if it is a microbatch"
    )


def _cells(cells: list[str], width: int) -> str:
    if cells == [""]:
        return ("a blank line, which is one empty cell; a microbatch whose parameters are all absent is "
                f"written {',' * (width - 1)!r}, with")
    return f"{len(cells)} cells"


def _csv_value(cell: str, where: str) -> int | float | None:
    cell = cell.strip()
    if cell == "":
        return None  # absent
    number = _csv.number(cell, where)
    if number is None:
        raise FormatError(f"{where}: expected a number or an empty cell (absent), got {short_repr(cell)}")
    return number


# --- writing -----------------------------------------------------------------------


class Columns(NamedTuple):
    """An owner-sum result as its two columns, written as the pairs ``zip(shards, totals)`` are.

    Each column is a sequence of plain Python values (ints, floats, strings,
    lists), or the native backend's ``array.array`` (``"q"`` shards, ``"d"`` or
    ``"q"`` totals): those are written in C (``gradagg._native._pairtext``) to
    the same text, byte for byte, without a Python object per number (what is
    left is float.__repr__'s own digit search; figures in bench/RESULTS.md).
    Without that module, the pairs are written in Python.
    """

    shards: Sequence[Any]
    totals: Sequence[Any]


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
    >>> from array import array
    >>> dumps_result(Columns(array("q", [3, 7]), array("d", [-0.0, float("nan")])))
    '[[3, -0.0], [7, NaN]]'
    """
    if isinstance(result, Columns):
        fast = _native_text(result, csv=False)
        if fast is not None:
            return fast
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
        fast = _native_text(result, csv=True)
        if fast is not None:
            return "shard_id,total\n" + fast
        result = list(zip(*result))
    try:
        if contract == "owner-sum":
            lines = ["shard_id,total"] + [f"{_cell(s)},{_cell(t)}" for s, t in result]
        else:
            lines = ["parameter,mean"] + [f"{j},{_cell(m)}" for j, m in enumerate(result)]
    except ValueError:
        raise _unwritable(result) from None
    return "\n".join(lines) + "\n"


def _native_text(columns: Columns, *, csv: bool) -> str | None:
    """The columns' JSON or CSV lines written in C, or None where that does not apply (other columns, not built).

    Only int64 shards with float64 or int64 totals of the same length: every such number's text is one rule
    (repr; json's NaN and Infinity), and none can be too long to write, so the C text is the pairs' text.
    """
    if not is_table_result(*columns):
        return None
    module = load("_pairtext")
    return None if module is None else module.pairs_text(*columns, csv)


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
