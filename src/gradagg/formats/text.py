"""File formats: JSON, JSON Lines and CSV readers, and atomic writers.

Readers return plain Python rows for :mod:`gradagg.reference`; they check the
*shape* of the file (a parse error names the line), and leave the contract
checks (ids, gradient types, lengths) to the reference, which names the row.
Rows are numbered from 0 in file order, not counting a CSV header.

Owner-sum inputs, one row per ``(shard_id, worker_id, owner_id, gradient)``:

* ``.json``  a JSON array of 4-element arrays (the case documents' form);
* ``.jsonl`` one row a line: a 4-element array, or an object with exactly the
  keys ``shard_id, worker_id, owner_id, gradient``;
* ``.csv``   header ``shard_id,worker_id,owner_id,gradient``. An id cell that is
  a canonical integer (``7``, ``-3``; not ``007``) becomes an int, any other
  cell stays a string. A gradient cell is a number (``nan``/``inf`` allowed) or
  a JSON array for a vector gradient (``"[1, 2.5]"``).

Microbatch-mean inputs, M microbatches of P values, absent written as null:

* ``.json``  ``{"rows": [...], "active_counts": [...]}`` or a bare array of rows;
* ``.jsonl`` one microbatch a line, a JSON array;
* ``.csv``   one microbatch a line, an empty cell meaning absent. The first line
  is a header of parameter names when any of its cells is not a number.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, Literal, TypeAlias

from gradagg.errors import FormatError, RowShapeError

Format: TypeAlias = Literal["json", "jsonl", "csv", "parquet"]
FORMATS: tuple[str, ...] = ("json", "jsonl", "csv", "parquet")
OWNER_FIELDS = ("shard_id", "worker_id", "owner_id", "gradient")
_EXTENSIONS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
_CANONICAL_INT = re.compile(r"-?(0|[1-9][0-9]*)")


def detect_format(path: str, explicit: str | None) -> str:
    """The format named by ``--format``, else by the file's extension.

    >>> detect_format("grads.jsonl", None)
    'jsonl'
    """
    if explicit is not None:
        return explicit
    if path == "-":
        raise FormatError("reading stdin ('-') needs --format (json, jsonl, csv or parquet)")
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise FormatError(f"{path}: cannot tell the format from extension {ext!r}; pass --format")
    return _EXTENSIONS[ext]


def read_text(path: str) -> str:
    """The whole text of ``path``, or of standard input for ``-``."""
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


# --- owner-sum rows ------------------------------------------------------------


def read_owner_rows(text: str, fmt: str, source: str = "input") -> list[Any]:
    """Parse owner-sum rows from ``text`` in format ``fmt``.

    >>> read_owner_rows('[["x", "a", "a", 1]]', "json")
    [['x', 'a', 'a', 1]]
    """
    if fmt == "json":
        rows = _load_json(text, source)
        if not isinstance(rows, list):
            raise FormatError(f"{source}: expected a JSON array of rows, got {type(rows).__name__}")
        return rows
    if fmt == "jsonl":
        return [_owner_row_from_json(value, line, source) for line, value in _json_lines(text, source)]
    if fmt == "csv":
        return list(_owner_rows_from_csv(text, source))
    raise FormatError(f"{source}: format {fmt!r} is not readable here")


def owner_columns(rows: list[Any]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """Owner-sum rows as four columns (shard, worker, owner, gradient) for the columnar engines.

    Only the row shape is checked here (the same message as the reference's);
    the engine checks the ids and gradients and names their rows.

    >>> owner_columns([["x", "a", "a", 1], ["y", "b", "c", 2]])
    (['x', 'y'], ['a', 'b'], ['a', 'c'], [1, 2])
    """
    for r, row in enumerate(rows):
        if isinstance(row, (str, bytes, dict)) or not isinstance(row, (list, tuple)):
            raise RowShapeError(f"row {r}: expected a list [shard_id, worker_id, owner_id, gradient], got {row!r}")
        if len(row) != 4:
            raise RowShapeError(
                f"row {r}: expected 4 fields [shard_id, worker_id, owner_id, gradient], got {len(row)}: {list(row)!r}"
            )
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]


def _owner_row_from_json(value: Any, line: int, source: str) -> Any:
    if not isinstance(value, dict):
        return value  # an array row, or garbage that the reference names by row
    keys = set(value)
    if keys != set(OWNER_FIELDS):
        missing = sorted(set(OWNER_FIELDS) - keys)
        extra = sorted(keys - set(OWNER_FIELDS))
        raise FormatError(
            f"{source}: line {line}: object keys must be {', '.join(OWNER_FIELDS)}; "
            f"missing {missing}, unexpected {extra}"
        )
    return [value[k] for k in OWNER_FIELDS]


def _owner_rows_from_csv(text: str, source: str) -> Iterator[list[Any]]:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        return
    if [h.strip() for h in header] != list(OWNER_FIELDS):
        raise FormatError(f"{source}: line 1: CSV header must be {','.join(OWNER_FIELDS)}, got {','.join(header)}")
    for cells in reader:
        line = reader.line_num
        if not cells:
            continue  # a blank line
        if len(cells) != 4:
            raise FormatError(f"{source}: line {line}: expected 4 cells, got {len(cells)}: {cells!r}")
        ids = [_csv_id(c) for c in cells[:3]]
        yield [*ids, _csv_gradient(cells[3], line, source)]


def _csv_id(cell: str) -> int | str | None:
    cell = cell.strip()
    if cell == "":
        return None  # the reference reports a missing id with its row
    return int(cell) if _CANONICAL_INT.fullmatch(cell) else cell


def _csv_gradient(cell: str, line: int, source: str) -> Any:
    cell = cell.strip()
    if cell.startswith("["):
        return _load_json(cell, f"{source}: line {line}: gradient")
    number = _csv_number(cell)
    if number is None:
        raise FormatError(f"{source}: line {line}: gradient must be a number or a JSON array, got {cell!r}")
    return number


def _csv_number(cell: str) -> int | float | None:
    if _CANONICAL_INT.fullmatch(cell):
        return int(cell)
    try:
        return float(cell)
    except ValueError:
        return None


# --- microbatch rows -----------------------------------------------------------


def read_microbatches(text: str, fmt: str, source: str = "input") -> tuple[list[Any], list[Any] | None]:
    """Parse ``(rows, active_counts)`` for microbatch-mean from ``text``.

    >>> read_microbatches('{"rows": [[2, null], [4, 6]], "active_counts": [1, 2]}', "json")
    ([[2, None], [4, 6]], [1, 2])
    """
    if fmt == "json":
        return _microbatches_from_json(_load_json(text, source), source)
    if fmt == "jsonl":
        return [value for _, value in _json_lines(text, source)], None
    if fmt == "csv":
        return _microbatches_from_csv(text, source), None
    raise FormatError(f"{source}: format {fmt!r} is not readable here")


def _microbatches_from_json(data: Any, source: str) -> tuple[list[Any], list[Any] | None]:
    if isinstance(data, list):
        return data, None
    if not isinstance(data, dict) or "rows" not in data:
        raise FormatError(f'{source}: expected {{"rows": [...], "active_counts": [...]}} or an array of rows')
    extra = sorted(set(data) - {"rows", "active_counts"})
    if extra:
        raise FormatError(f"{source}: unexpected keys {extra}; allowed are rows, active_counts")
    rows, counts = data["rows"], data.get("active_counts")
    if not isinstance(rows, list):
        raise FormatError(f'{source}: "rows" must be an array, got {type(rows).__name__}')
    return rows, counts


def _microbatches_from_csv(text: str, source: str) -> list[Any]:
    rows = [cells for cells in csv.reader(io.StringIO(text)) if cells]
    if rows and any(c.strip() and _csv_number(c.strip()) is None for c in rows[0]):
        rows = rows[1:]  # a header of parameter names
    return [[_csv_value(c, i, j, source) for j, c in enumerate(cells)] for i, cells in enumerate(rows)]


def _csv_value(cell: str, i: int, j: int, source: str) -> int | float | None:
    cell = cell.strip()
    if cell == "":
        return None  # absent
    number = _csv_number(cell)
    if number is None:
        raise FormatError(f"{source}: microbatch {i}, parameter {j}: expected a number or an empty cell, got {cell!r}")
    return number


# --- shared parsing --------------------------------------------------------------


def _load_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None


def _json_lines(text: str, source: str) -> Iterator[tuple[int, Any]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield number, _load_json(line, f"{source}: line {number}")


# --- writing -----------------------------------------------------------------------


def dumps_result(result: Any) -> str:
    """The JSON text of a result (NaN and Infinity written as Python's json does).

    >>> dumps_result([["x", 1], ["y", 2]])
    '[["x", 1], ["y", 2]]'
    """
    return json.dumps(result)


def result_to_csv(result: Any, contract: str) -> str:
    """A result as CSV: ``shard_id,total`` rows, or ``parameter,mean`` rows."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if contract == "owner-sum":
        writer.writerow(["shard_id", "total"])
        writer.writerows([s, json.dumps(t) if isinstance(t, list) else t] for s, t in result)
    else:
        writer.writerow(["parameter", "mean"])
        writer.writerows(enumerate(result))
    return out.getvalue()
