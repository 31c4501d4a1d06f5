"""Owner-sum results written as Parquet without pyarrow or NumPy: the native path's output, in pure Python.

Writing only. :func:`write_owner_sum` takes exactly what the native backend
(:mod:`gradagg.backends.native`) returns, ``array("q")`` shards and
``array("d")`` or ``array("q")`` totals, and writes the file that
:func:`gradagg.formats.parquet.write_owner_sum` (pyarrow) would write for them,
as a reader sees it: ``shard_id`` INT64 and ``total`` DOUBLE (INT64 for integer
totals), both OPTIONAL (nullable, in Arrow) with every value defined. For
anything else (string ids, vector totals, NumPy arrays, lists, a big-endian
machine) it returns False and writes nothing: the caller writes with pyarrow.

The file (apache/parquet-format): ``PAR1``; per row group of at most
:data:`GROUP_ROWS` rows, per column, data pages v1 of at most
:data:`PAGE_ROWS` values, each a page header, the definition levels (a 4-byte
length, then one RLE run of 1s: every value is defined) and the values PLAIN:
the arrays' own bytes, 8 little-endian bytes a value, so every bit (a NaN's
payload, -0.0) is kept. No compression. Then the footer and ``PAR1``. An
empty result is a file of no row group.

Where the bytes differ from pyarrow's, and why a reader (pyarrow, pandas,
polars, DuckDB, gradagg's own) gets the same types and values:

* no dictionary pages, no compression: a result holds each shard once, so a
  dictionary saves little, and the bytes are written as they are; the file is
  larger than pyarrow's (1.3x for 10^6 shards of random float totals);
* statistics hold the null count (0), which gradagg's own reader needs to take
  an OPTIONAL column, but no min/max: they are optional, and a wrong one (NaN
  and -0.0 have rules) would be worse than none;
* no ``ARROW:schema`` key-value: pyarrow writes it to bring back Arrow types that
  Parquet's cannot say (a duration, a large string); INT64 and DOUBLE without a
  logical type read back as int64 and float64 either way, and pyarrow drops
  that key from the schema it returns, so ``pq.read_schema`` is equal,
  metadata included;
* ``created_by`` is ``gradagg version X``, the file format version 1 (it uses
  nothing newer).
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

from gradagg import __version__
from gradagg._native import is_table_result
from gradagg.formats._thrift_write import BINARY, I16, I32, I64, LIST, STRUCT, Field, encode_struct, uleb128
from gradagg.formats.atomic import write_atomic

GROUP_ROWS = 1 << 20  # rows a row group: pyarrow's default, and within the native reader's limit
PAGE_ROWS = 1 << 17  # values a page: 1 MiB of them, pyarrow's default page size
MAGIC = b"PAR1"
_INT64, _DOUBLE = 2, 5  # parquet.thrift Type
_REQUIRED, _OPTIONAL = 0, 1  # FieldRepetitionType
_PLAIN, _RLE = 0, 3  # Encoding (RLE: the definition levels)
_UNCOMPRESSED, _DATA_PAGE = 0, 0  # CompressionCodec, PageType
Columns = list[tuple[str, int, memoryview]]  # (name, physical type, the values' bytes)


def write_owner_sum(path: str, shards: Any, totals: Any) -> bool:
    """Write owner-sum results to ``path`` as Parquet (``shard_id``, ``total``), atomically, if this writer takes them.

    Args:
        path: the output file (see :func:`gradagg.formats.atomic.atomic_path` for what it may be).
        shards: S shard ids.
        totals: S totals.

    Returns:
        True once written; False, with nothing written, when :func:`takes` says no.

    Raises:
        OutputError, OSError: ``path`` cannot be written (the old file, if any, is kept).

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "out.parquet")
    >>> write_owner_sum(path, array("q", [3, 7]), array("d", [0.5, -2.0])), open(path, "rb").read(4)
    (True, b'PAR1')
    >>> write_owner_sum(path, ["x"], [1.0])  # string ids: pyarrow's writer's job
    False
    """
    if not takes(shards, totals):
        return False
    write_atomic(path, encode_owner_sum(shards, totals))
    return True


def takes(shards: Any, totals: Any) -> bool:
    """Whether this writer writes these results: ``array("q")`` shards, as many ``array("q"|"d")`` totals.

    The values are written as the machine holds them, so only on a little-endian machine (Parquet's order).

    >>> takes(array("q", [1]), array("q", [2])), takes(array("q", [1]), [2])
    (True, False)
    """
    return sys.byteorder == "little" and is_table_result(shards, totals)


def encode_owner_sum(shards: array[int], totals: array[Any]) -> bytes:
    """The Parquet file's bytes for these results (see the module's docstring for the layout).

    Args:
        shards: S shard ids, ``array("q")``.
        totals: S totals, ``array("d")`` or ``array("q")``.

    Returns:
        The whole file.

    Raises:
        ValueError: results that :func:`takes` refuses.
    """
    if not takes(shards, totals):
        raise ValueError("the native Parquet writer takes array('q') shards and as many array('q' or 'd') totals")
    columns: Columns = [("shard_id", _INT64, memoryview(shards).cast("B")),
                        ("total", _DOUBLE if totals.typecode == "d" else _INT64, memoryview(totals).cast("B"))]
    out = _Out()
    groups = [_row_group(out, k, columns, first, min(len(shards), first + GROUP_ROWS))
              for k, first in enumerate(range(0, len(shards), GROUP_ROWS))]
    footer = encode_struct(_file_metadata(columns, len(shards), groups))
    out.add(footer, len(footer).to_bytes(4, "little"), MAGIC)
    return b"".join(out.parts)


class _Out:
    """The file's parts in order, and the offset the next one starts at."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = [MAGIC]
        self.pos = len(MAGIC)

    def add(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            self.parts.append(part)
            self.pos += len(part)


def _row_group(out: _Out, ordinal: int, columns: Columns, first: int, end: int) -> list[Field]:
    """Write rows ``first:end`` of every column; return the RowGroup struct."""
    start = out.pos
    chunks = [_column_chunk(out, name, ptype, data[8 * first : 8 * end]) for name, ptype, data in columns]
    size = out.pos - start
    return [(1, LIST, (STRUCT, chunks)), (2, I64, size), (3, I64, end - first), (5, I64, start),
            (6, I64, size), (7, I16, ordinal)]


def _column_chunk(out: _Out, name: str, ptype: int, data: memoryview) -> list[Field]:
    """Write one column chunk's pages; return its ColumnChunk struct."""
    start = out.pos
    for at in range(0, len(data), 8 * PAGE_ROWS):
        out.add(*_data_page(data[at : at + 8 * PAGE_ROWS]))
    size = out.pos - start
    meta: list[Field] = [
        (1, I32, ptype), (2, LIST, (I32, [_PLAIN, _RLE])), (3, LIST, (BINARY, [name])), (4, I32, _UNCOMPRESSED),
        (5, I64, len(data) // 8), (6, I64, size), (7, I64, size), (9, I64, start),
        (12, STRUCT, [(3, I64, 0)]),  # Statistics: null_count 0, no min/max
    ]
    return [(2, I64, 0), (3, STRUCT, meta)]  # file_offset (deprecated) 0, as pyarrow writes it


def _data_page(values: memoryview) -> tuple[bytes, bytes, memoryview]:
    """A data page v1 of ``values`` (8 bytes each), every one defined: header, definition levels, values."""
    n = len(values) // 8
    run = uleb128(n << 1) + b"\x01"  # an RLE run (header: count << 1, low bit 0) of n levels of 1, in one byte
    levels = len(run).to_bytes(4, "little") + run
    body = len(levels) + len(values)
    header = encode_struct([
        (1, I32, _DATA_PAGE), (2, I32, body), (3, I32, body),
        (5, STRUCT, [(1, I32, n), (2, I32, _PLAIN), (3, I32, _RLE), (4, I32, _RLE)]),  # DataPageHeader
    ])
    return header, levels, values


def _file_metadata(columns: Columns, rows: int, groups: list[list[Field]]) -> list[Field]:
    schema: list[list[Field]] = [[(3, I32, _REQUIRED), (4, BINARY, "schema"), (5, I32, len(columns))]]
    schema += [[(1, I32, ptype), (3, I32, _OPTIONAL), (4, BINARY, name)] for name, ptype, _ in columns]
    return [(1, I32, 1), (2, LIST, (STRUCT, schema)), (3, I64, rows), (4, LIST, (STRUCT, groups)),
            (6, BINARY, f"gradagg version {__version__}")]
