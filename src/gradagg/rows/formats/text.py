"""JSON, JSON Lines and CSV: text into rows. Read only (results are written by :mod:`gradagg.rows.formats.results`).

Readers turn text into the plain Python rows of :mod:`gradagg.reference` and
nothing else (each format's reader is one module: :mod:`gradagg.rows.formats._json`,
:mod:`gradagg.rows.formats._csv`): they check the *text* (a parse error names the line), never the
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

from typing import Any

from gradagg.errors import FormatError
from gradagg.rows.formats import _csv, _json
from gradagg.rows.formats._json import OWNER_FIELDS

__all__ = ["OWNER_FIELDS", "check_header", "read_microbatches", "read_owner_rows"]


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
