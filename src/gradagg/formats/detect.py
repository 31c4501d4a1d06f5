"""Which format an input is in, and its bytes as text: before any reader runs.

Files are recognised by ``--format`` or their extension (:func:`format_of`);
standard input by ``--format`` or its content (:func:`sniff`), which picks the
only reading that could be valid and never guesses between two.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import re
from typing import BinaryIO, NamedTuple

from gradagg.errors import FormatError

_SPACES = re.compile(rb"[ \t\r\n]*")
_PARQUET_MAGIC = b"PAR1"
_EXTENSIONS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}


class Input(NamedTuple):
    """An input, read: its format, its name for messages, and its content for the reader of that format."""

    fmt: str
    name: str  # the path, or <stdin>
    data: bytes | None  # the whole text input, undecoded (see decode); None for Parquet
    parquet: str | BinaryIO | None  # a Parquet file's path, or standard input's bytes as a file
    sniffed: bool  # the format was recognised by content, not named

    def text(self) -> str:
        """The text of a text input (see :func:`decode`)."""
        return decode(self.data or b"", self.name)


def read_input(path: str, explicit: str | None, contract: str, stdin: BinaryIO | None) -> Input:
    """Find the format of ``path`` (``-``: ``stdin``) and read a text input whole; a Parquet file is left to stream.

    Args:
        path: the input file, or ``-`` for standard input.
        explicit: the ``--format`` value, or None.
        contract: ``owner-sum`` or ``microbatch-mean`` (see :func:`sniff`).
        stdin: standard input, as bytes (None when the process has none: it was closed).

    Returns:
        The :class:`Input`.

    Raises:
        FormatError: a file of unknown extension and no ``--format``; ``-`` with standard input closed.
        OSError: the file is missing, a directory, unreadable.

    >>> read_input("-", None, "owner-sum", io.BytesIO(b"[]")).fmt
    'json'
    """
    if path != "-":
        fmt = format_of(path, explicit)
        if fmt == "parquet":
            return Input(fmt, path, None, path, False)
        with open(path, "rb") as f:
            return Input(fmt, path, f.read(), None, False)
    if stdin is None:
        raise FormatError("<stdin>: standard input is closed; give a FILE, or open standard input")
    data = stdin.read()
    fmt = explicit or sniff(data, contract)
    if fmt == "parquet":  # its footer is at its end: it is read from memory
        return Input(fmt, "<stdin>", None, io.BytesIO(data), explicit is None)
    return Input(fmt, "<stdin>", data, None, explicit is None)


def format_of(path: str, explicit: str | None) -> str:
    """The format named by ``--format``, else by the file's extension.

    Args:
        path: the input file (not ``-``: standard input is recognised by :func:`sniff`).
        explicit: the ``--format`` value, or None.

    Returns:
        ``json``, ``jsonl``, ``csv`` or ``parquet``.

    Raises:
        FormatError: no ``--format`` and an unknown extension.

    >>> format_of("grads.jsonl", None), format_of("grads.txt", "csv")
    ('jsonl', 'csv')
    """
    if explicit is not None:
        return explicit
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise FormatError(f"{path}: cannot tell the format from extension {ext!r}; pass --format "
                          "json, jsonl, csv or parquet")
    return _EXTENSIONS[ext]


def sniff(data: bytes, contract: str) -> str:
    """The format of standard input, recognised by content; only the one reading that could be valid is chosen.

    Parquet starts with the magic bytes ``PAR1``. Text that does not start
    (after spaces and a byte-order mark) with ``[`` or ``{`` is CSV: a JSON
    input starts with one. Then, with two or more non-blank lines, the first
    line is a whole JSON value in JSON Lines and never in a valid JSON
    document. A single line is JSON when it is an array of arrays (or
    objects), or empty, or, for the mean, an object; it is a JSON Lines row
    when it is an array of values, or, for owner-sum, an object.

    Args:
        data: the whole input.
        contract: ``owner-sum`` or ``microbatch-mean``.

    Returns:
        ``json``, ``jsonl``, ``csv`` or ``parquet``.

    >>> sniff(b'[["x", "a", "a", 1]]', "owner-sum"), sniff(b'["x", "a", "a", 1]', "owner-sum")
    ('json', 'jsonl')
    >>> sniff(b"1,2\\n3,4\\n", "microbatch-mean")
    'csv'
    """
    if data.startswith(_PARQUET_MAGIC):
        return "parquet"
    start = _skip_spaces(data, len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
    first = data[start:start + 1]
    if first not in (b"[", b"{"):
        return "csv"
    lines = _first_lines(data, start, 2)
    if len(lines) == 2:
        try:
            json.loads(lines[0])
        except json.JSONDecodeError:
            return "json"  # a document over several lines
        except (ValueError, RecursionError):
            pass  # a whole value, only a bad one: the JSON Lines reader names it
        return "jsonl"
    if first == b"{":
        return "jsonl" if contract == "owner-sum" else "json"
    after = _skip_spaces(data, start + 1)
    return "json" if data[after:after + 1] in (b"[", b"]", b"{") else "jsonl"


def _skip_spaces(data: bytes, start: int) -> int:
    match = _SPACES.match(data, start)  # always matches, perhaps nothing
    return match.end() if match else start


def _first_lines(data: bytes, start: int, count: int) -> list[bytes]:
    """The first ``count`` non-blank lines from ``start`` (without reading further)."""
    lines: list[bytes] = []
    while len(lines) < count and start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        if data[start:end].strip(b" \t\r"):
            lines.append(data[start:end])
        start = end + 1
    return lines




def decode(data: bytes, source: str) -> str:
    """The UTF-8 text of ``data`` (a leading byte-order mark dropped).

    Args:
        data: the whole input.
        source: the input's name for messages (a path, or ``<stdin>``).

    Returns:
        The text.

    Raises:
        FormatError: the input is empty, or not UTF-8 (naming the byte, its offset and line).

    >>> decode(b'\\xef\\xbb\\xbf[1]', "in.json")
    '[1]'
    """
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise FormatError(
            f"{source}: not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} (line {line}): {exc.reason}"
        ) from None
    if not text:
        raise FormatError(f"{source}: the input is empty (0 bytes); an input with no rows is [] in JSON "
                          "or a header line in CSV")
    return text
