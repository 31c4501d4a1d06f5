"""CSV records and cells, by the rules of :mod:`gradagg.formats.text` (no line skipped, strict numbers)."""

from __future__ import annotations

import contextlib
import csv
import io
import math
import re
import sys
from collections.abc import Iterator

from gradagg.errors import FormatError, short_repr

CANONICAL_INT = re.compile(r"0|-?[1-9][0-9]*")
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SPECIAL = {s: float(s) for s in ("nan", "inf", "infinity")}


def is_number(cell: str) -> bool:
    """Whether a (stripped) CSV cell is written as a number, by the grammar of :mod:`gradagg.formats.text`."""
    return bool(_INT.fullmatch(cell) or _FLOAT.fullmatch(cell)) or _special(cell) is not None


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


def too_many_digits(digits: str) -> str:
    """The message for an integer longer than Python converts from text."""
    return (f"an integer of {len(digits.lstrip('+-'))} digits, over Python's limit of "
            f"{sys.get_int_max_str_digits()} digits for reading one as text")


def records(text: str, source: str) -> list[tuple[int, list[str]]]:
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
