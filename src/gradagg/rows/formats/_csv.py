"""CSV by the rules of :mod:`gradagg.rows.formats.text` (no line skipped, strict numbers): records, cells, and the
readers of both contracts' CSV inputs, so that a CSV input is read in this module from its text to its rows.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import re
import sys
from collections.abc import Iterator
from typing import Any

from gradagg.errors import FormatError, short_repr
from gradagg.rows.formats._json import OWNER_FIELDS, load_json, too_many_digits

CANONICAL_INT = re.compile(r"0|-?[1-9][0-9]*")
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SPECIAL = {s: float(s) for s in ("nan", "inf", "infinity")}
NUMBER = re.compile(_FLOAT.pattern + r"|[+-]?(?:[nN][aA][nN]|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?)")
"""A (stripped) CSV cell written as a number, by the grammar of :mod:`gradagg.rows.formats.text` (with ``fullmatch``):
a decimal (an integer is one), or ``nan``, ``inf``, ``infinity`` in any case, each with an optional sign."""


def is_number(cell: str) -> bool:
    """Whether a (stripped) CSV cell is written as a number (:data:`NUMBER`)."""
    return NUMBER.fullmatch(cell) is not None


def _special(cell: str) -> float | None:
    sign = cell[:1] if cell[:1] in ("+", "-") else ""
    value = _SPECIAL.get(cell[len(sign):].lower())
    return None if value is None else -value if sign == "-" else value


def number(cell: str, where: str) -> int | float | None:
    """The number a (stripped) CSV cell holds, or None when it holds none."""
    if _INT.fullmatch(cell):
        return to_int(cell, where)
    special = _special(cell)
    if special is not None:
        return special
    if not _FLOAT.fullmatch(cell):
        return None
    value = float(cell)
    if math.isinf(value):
        raise FormatError(f"{where}: number {short_repr(cell)} is too large for a float (over 1.8e308)")
    return value


def to_int(digits: str, where: str) -> int:
    """``int(digits)``, or an error naming ``where`` when Python would refuse that many digits."""
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("+-")) > limit:
        raise FormatError(f"{where}: {too_many_digits(digits)}")
    return int(digits)


def _records(text: str, source: str) -> list[tuple[int, list[str]]]:
    """Every CSV record with the line it starts on; a blank line is one empty cell (RFC 4180), never skipped."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    records = []
    start = 1
    try:
        with _no_field_limit():
            for cells in reader:
                records.append((start, cells or [""]))
                start = reader.line_num + 1
    except csv.Error as exc:
        raise FormatError(f"{source}: line {start}: invalid CSV: {exc}") from None
    return records


@contextlib.contextmanager
def _no_field_limit() -> Iterator[None]:
    """Lift the csv module's 128 KiB cell limit while reading: the text is already in memory, and a vector
    gradient's JSON cell can be longer. The limit is process-wide, so it is restored afterwards."""
    old = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)
    try:
        yield
    finally:
        csv.field_size_limit(old)


def owner_rows(text: str, source: str) -> list[list[Any]]:
    """Owner-sum rows of a CSV input (see :func:`gradagg.rows.formats.text.read_owner_rows`)."""
    records = _records(text, source)
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
    if CANONICAL_INT.fullmatch(cell):
        return to_int(cell, f"{source}: line {line}: {name}")
    return cell


def _csv_gradient(cell: str, line: int, source: str) -> Any:
    cell = cell.strip()
    if cell.startswith("["):
        return load_json(cell, f"{source}: line {line}: gradient")
    value = number(cell, f"{source}: line {line}: gradient")
    if value is None:
        raise FormatError(f"{source}: line {line}: gradient must be a number or a JSON array, got {short_repr(cell)}")
    return value


def microbatches(text: str, source: str, header: bool | None) -> list[list[Any]]:
    """The microbatches of a CSV input (see :func:`gradagg.rows.formats.text.read_microbatches`)."""
    records = _records(text, source)
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
    names = [c for c in cells if c.strip() and not is_number(c.strip())]
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
    value = number(cell, where)
    if value is None:
        raise FormatError(f"{where}: expected a number or an empty cell (absent), got {short_repr(cell)}")
    return value
