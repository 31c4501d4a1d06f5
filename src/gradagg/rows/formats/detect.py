"""Which format an input or output is in, and an input's bytes: before any reader or writer runs.

The one table of formats is :data:`INPUT_FORMATS` and :data:`OUTPUT_FORMATS`
(by extension). Files are recognised by ``--format`` or their extension
(:func:`format_of`); standard input, and a FIFO or device whose name has no
known extension (``<(cat x.parquet)`` is ``/dev/fd/63``), by ``--format`` or its content
(:func:`sniff`), which picks the only reading that could be valid and never
guesses between two. An output is written in the format its extension names,
JSON when it names none.

A regular Parquet file is left to its reader, which streams it. Every other
input is read here, once, into memory: text (its readers take it whole), and
standard input, a FIFO, ``<(cat x.parquet)`` or a device in any format, since
such an input cannot be reopened or read from its end. What is read is
bounded by :func:`memory_allowed`, and an input larger than that is an error
naming it, before its bytes are read where its size is known.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import os
import re
import stat
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

from gradagg.errors import FormatError, GradaggError
from gradagg.options import EXTENSIONS
from gradagg.rows.formats._csv import NUMBER
from gradagg.rows.formats._json import OWNER_FIELDS

_SPACES = re.compile(rb"[ \t\r\n]*")
_PARQUET_MAGIC = b"PAR1"
INPUT_FORMATS = EXTENSIONS
"""The input formats by extension (lower case); a file of any other extension needs ``--format``."""
OUTPUT_FORMATS = EXTENSIONS
"""The output formats by extension: a result is written in the format it would be read in; JSON otherwise
(:func:`gradagg.rows.formats.results.output_format`)."""
_COMMANDS = {"owner-sum": "owner-sum", "microbatch-mean": "mean"}  # each contract's command
_CHUNK = 1 << 20  # bytes per read of an input whose size is not known
_JSON = ("json", "jsonl")


class Input(NamedTuple):
    """An input, read: its format, its name for messages, and its content for the reader of that format."""

    fmt: str
    name: str  # the path, or <stdin>
    text: str  # the whole text input, decoded (see decode); "" for Parquet
    parquet: str | BinaryIO | None  # a regular Parquet file's path, or the bytes of another Parquet input as a file
    sniffed: bool  # the format was recognised by content, not named


def read_input(path: str, explicit: str | None, contract: str, stdin: BinaryIO | None) -> Input:
    """Find the format of ``path`` (``-``: ``stdin``) and read it, unless it is a regular Parquet file.

    Args:
        path: the input file, or ``-`` for standard input.
        explicit: the ``--format`` value, or None.
        contract: ``owner-sum`` or ``microbatch-mean`` (see :func:`sniff`).
        stdin: standard input, as bytes (None when the process has none: it was closed).

    Returns:
        The :class:`Input`.

    Raises:
        FormatError: a directory; a file of unknown extension and no ``--format``; ``-`` with standard
            input closed; an input larger than :func:`memory_allowed` allows to read; text that is
            empty or not UTF-8 (see :func:`decode`).
        OSError: the file is missing or unreadable.

    >>> read_input("-", None, "owner-sum", io.BytesIO(b"[]")).fmt
    'json'
    """
    if path == "-":
        if stdin is None:
            raise FormatError("<stdin>: standard input is closed; give a FILE, or open standard input")
        return _in_memory(read_bounded(stdin, "<stdin>", json_text=explicit in _JSON), "<stdin>", explicit, contract)
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise FormatError(f"{path}: is a directory; FILE must be a file, or - for standard input")
    if not stat.S_ISREG(mode):  # a FIFO, a device, <(...): one pass, into memory, recognised as stdin is
        named = explicit or INPUT_FORMATS.get(os.path.splitext(path)[1].lower())
        with open(path, "rb") as f:
            return _in_memory(read_bounded(f, path, json_text=named in _JSON), path, named, contract)
    fmt = format_of(path, explicit)
    if fmt == "parquet":
        return Input(fmt, path, "", path, False)
    with open(path, "rb") as f:
        return Input(fmt, path, decode(read_bounded(f, path, os.fstat(f.fileno()).st_size), path), None, False)


def _in_memory(data: bytes, name: str, named: str | None, contract: str) -> Input:
    fmt = named or sniff(data, contract)
    if fmt == "parquet":  # its footer is at its end: it is read from memory
        return Input(fmt, name, "", io.BytesIO(data), named is None)
    return Input(fmt, name, decode(data, name), None, named is None)


def read_bounded(f: BinaryIO, name: str, size: int | None = None, *, json_text: bool = False) -> bytes:
    """All of ``f``, or an error naming ``name`` once it is more than :func:`memory_allowed` allows.

    Args:
        f: the open input.
        name: its name for messages.
        size: its size when known (a regular file): checked before anything is read.
        json_text: the input is JSON or JSON Lines, where a NUL byte is never valid (not a space, and
            a control character inside a string): reading stops at the first one, so ``/dev/zero``
            ends at once, and the reader reports the first error, which is there or before it.

    Returns:
        The bytes.

    Raises:
        FormatError: the input is larger than the bound.

    >>> read_bounded(io.BytesIO(b"[1]"), "x.json")
    b'[1]'
    """
    bound = memory_allowed() // 2
    if size is not None and size > bound:
        raise _too_large(name, f"is {size:,} bytes", bound)
    chunks, total = [], 0
    while chunk := f.read((size or 0) + _CHUNK):  # a known size: all of it in the first read
        chunks.append(chunk)
        total += len(chunk)
        if total > bound:
            raise _too_large(name, f"holds more than {bound:,} bytes (read so far)", bound)
        if json_text and b"\0" in chunk:  # the input is invalid: up to the NUL holds its first error
            chunks[-1] = chunk[:chunk.index(b"\0") + 1]
            break
    return b"".join(chunks)


def _too_large(name: str, what: str, bound: int) -> FormatError:
    return FormatError(f"{name}: {what}; an input read into memory may take at most half the memory allowed "
                       f"({bound:,} bytes; see ulimit -v): give a regular Parquet file, which is read in batches")


def memory_allowed() -> int:
    """The bytes this process may hold: the least of its address-space and data limits (``ulimit -v``,
    ``ulimit -d``), the machine's memory, and what of it is available now (Linux: beyond that, it swaps).

    >>> memory_allowed() > 0
    True
    """
    limits = [_available_memory()]
    with contextlib.suppress(ValueError, OSError, AttributeError):  # no sysconf (Windows), or no such name
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(ImportError):
        import resource

        for name in ("RLIMIT_AS", "RLIMIT_DATA"):
            soft = resource.getrlimit(getattr(resource, name))[0] if hasattr(resource, name) else -1
            if soft not in (-1, resource.RLIM_INFINITY):
                limits.append(soft)
    return min(limits)


def _available_memory() -> int:
    """MemAvailable of /proc/meminfo, in bytes; unbounded where there is no such file."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 2**63 - 1


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
    if ext not in INPUT_FORMATS:
        raise FormatError(f"{path}: cannot tell the format from extension {ext!r}; pass --format "
                          "json, jsonl, csv or parquet")
    return INPUT_FORMATS[ext]




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


@contextlib.contextmanager
def named_errors(source: Input, contract: str) -> Iterator[None]:
    """Errors in reading ``source`` or applying ``contract`` to it, named after it, with what may explain them.

    The contract's errors (``row 3: ...``) get the input's name in front (the readers' have it); an input
    recognised by its content says which ``--format`` reads it otherwise; an input that looks like the other
    contract's (:func:`contract_of`) says which command reads it.

    >>> try:
    ...     with named_errors(Input("json", "m.json", '{"rows": [[1]]}', None, False), "owner-sum"):
    ...         raise FormatError("expected a JSON array of rows, got dict")
    ... except FormatError as exc:
    ...     print(exc)
    m.json: expected a JSON array of rows, got dict (m.json looks like an input of `gradagg mean`, which reads it)
    """
    try:
        yield
    except GradaggError as exc:
        message = str(exc) if str(exc).startswith(f"{source.name}: ") else f"{source.name}: {exc}"
        if source.sniffed and isinstance(exc, FormatError):
            stream = "standard input" if source.name == "<stdin>" else source.name
            others = " or ".join(f for f in ("json", "jsonl", "csv") if f != source.fmt)
            message += (f" ({stream} was read as {source.fmt}, recognised by its content; "
                        f"pass --format {others} to read it otherwise)")
        other = contract_of(source)
        if other is not None and other != contract:
            message += f" ({source.name} looks like an input of `gradagg {_COMMANDS[other]}`, which reads it)"
        exc.args = (message,)
        raise


def contract_of(source: Input) -> str | None:
    """Which contract's input ``source`` looks like, from its shape alone: ``owner-sum``, ``microbatch-mean``
    or None (either, or neither). Only a hint for a message: the readers and the contract decide.

    Owner-sum rows are 4 values whose last is a number or a list of numbers (or JSON objects of its four
    keys, or a CSV under its header); mean rows are lists of numbers and nulls of one length (or a JSON
    object with ``rows``); in Parquet the owner-sum columns are named, the mean's are all numeric.

    >>> contract_of(Input("json", "m.json", '{"rows": [[1, null]]}', None, False))
    'microbatch-mean'
    >>> contract_of(Input("csv", "r.csv", "shard_id,worker_id,owner_id,gradient\\nx,a,a,1\\n", None, False))
    'owner-sum'
    """
    try:
        if source.fmt == "parquet":
            return _parquet_contract(source.parquet)
        if source.fmt == "jsonl":
            return _rows_contract([json.loads(line) for line in source.text.splitlines() if line.strip()])
        if source.fmt == "json":
            value = json.loads(source.text)
            if isinstance(value, dict):
                return "microbatch-mean" if "rows" in value else None
            return _rows_contract(value) if isinstance(value, list) else None
        return _csv_contract(source.text) if source.fmt == "csv" else None
    except Exception:  # noqa: BLE001  (a hint only: what cannot be read, pyarrow's errors included, gives none)
        return None


def _rows_contract(rows: list[object]) -> str | None:
    def number(x: object) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    def owner_row(r: object) -> bool:
        if isinstance(r, dict):
            return set(r) == set(OWNER_FIELDS)
        return (isinstance(r, list) and len(r) == 4 and all(isinstance(x, int | str) for x in r[:3])
                and (number(r[3]) or isinstance(r[3], list) and all(map(number, r[3]))))

    def mean_row(r: object) -> bool:
        return isinstance(r, list) and all(x is None or number(x) for x in r)

    owner = all(map(owner_row, rows))
    mean = all(map(mean_row, rows)) and len({len(r) for r in rows if isinstance(r, list)}) == 1
    return None if not rows or owner == mean else "owner-sum" if owner else "microbatch-mean"


def _csv_contract(text: str) -> str | None:
    lines = [line.split(",") for line in text.splitlines()[:50]]
    if lines and [c.strip() for c in lines[0]] == list(OWNER_FIELDS):
        return "owner-sum"
    cells = [c.strip() for line in lines[1:] for c in line]
    return "microbatch-mean" if all(c == "" or NUMBER.fullmatch(c) for c in cells) else None


def _parquet_contract(parquet: object) -> str | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if hasattr(parquet, "seek"):
        parquet.seek(0)
    schema = pq.read_schema(parquet)
    if set(OWNER_FIELDS) <= set(schema.names):
        return "owner-sum"
    numeric = all(pa.types.is_integer(f.type) or pa.types.is_floating(f.type) for f in schema)
    return "microbatch-mean" if numeric and schema.names else None
