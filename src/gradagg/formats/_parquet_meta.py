"""A Parquet file's footer, and the plan to decode some of its columns natively, or why not.

Standard library only. :func:`plan_columns` decides, per file and before any
row is read, whether :mod:`gradagg.formats.parquet_native` can decode the
columns asked for: each must be a flat top-level column (REQUIRED, or OPTIONAL
with every column chunk's statistics counting no null) of a plain physical
type (INT32, INT64, FLOAT, DOUBLE, with no logical type but a signed 32/64-bit
integer, and, when pyarrow wrote the file, the same plain type in its Arrow
schema), in PLAIN or dictionary encodings, UNCOMPRESSED or SNAPPY, in row groups
of at most :data:`MAX_GROUP_ROWS` rows, in this file. Anything else raises
:class:`Unsupported` with the reason, and the caller reads the file with
pyarrow instead. A footer that does not decode is Unsupported too: pyarrow then
says what is wrong with it, in the words users of the pyarrow path already see.

Field numbers are those of ``parquet.thrift`` (apache/parquet-format).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from gradagg.formats import _arrow_schema, _thrift

MAGIC = b"PAR1"
MAX_GROUP_ROWS = 1 << 22  # decoded at once: <= 96 MiB for four 8-byte columns; bigger groups go to pyarrow's batches
MAX_FOOTER = 64 << 20
INT32, INT64, FLOAT, DOUBLE = 1, 2, 4, 5  # Type
TYPE_NAMES = {INT32: "int32", INT64: "int64", FLOAT: "float32", DOUBLE: "float64"}
_REQUIRED, _OPTIONAL = 0, 1  # FieldRepetitionType
_CODECS = {0, 1}  # UNCOMPRESSED, SNAPPY
_ENCODINGS = {0, 2, 3, 8}  # PLAIN, PLAIN_DICTIONARY, RLE (levels), RLE_DICTIONARY
_SIGNED_INT_CONVERTED = {INT32: 17, INT64: 18}  # ConvertedType INT_32, INT_64
_INTEGER_LOGICAL = 10  # LogicalType.INTEGER: IntType {1: bitWidth, 2: isSigned}


class Unsupported(Exception):  # noqa: N818  (not an error: the file is read by pyarrow instead)
    """The native reader does not decode this file; the reason says why (pyarrow reads it instead)."""


class Chunk(NamedTuple):
    """Where one column chunk's pages are, and how to decode them."""

    start: int
    length: int
    physical_type: int
    codec: int
    max_definition_level: int  # 0 for a REQUIRED column, 1 for an OPTIONAL one (flat)


class Plan(NamedTuple):
    """The columns asked for, as physical types, and every row group's row count and column chunks."""

    types: tuple[int, ...]
    row_groups: list[tuple[int, tuple[Chunk, ...]]]

    @property
    def rows(self) -> int:
        """Rows in the file (the sum of its row groups')."""
        return sum(rows for rows, _ in self.row_groups)


def read_footer(read_at: Any, size: int) -> dict[int, Any]:
    """Decode the footer (``FileMetaData``) of a Parquet file of ``size`` bytes.

    Args:
        read_at: ``read_at(offset, length) -> bytes``.
        size: the file's size in bytes.

    Returns:
        The ``FileMetaData`` fields by number.

    Raises:
        Unsupported: no Parquet magic at both ends, an implausible footer length,
            or a footer that does not decode (pyarrow will say what is wrong).
    """
    if size < 12 or read_at(0, 4) != MAGIC:
        raise Unsupported("no Parquet magic at the start of the file")
    tail = read_at(size - 8, 8)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != MAGIC or not 0 < length <= min(size - 12, MAX_FOOTER):
        raise Unsupported("no plain Parquet footer (an encrypted one, or none)")
    try:
        meta, end = _thrift.read_struct(read_at(size - 8 - length, length))
    except _thrift.ThriftError as exc:
        raise Unsupported(f"the footer does not decode: {exc}") from None
    meta[-1] = size - 8 - length  # where the footer starts: every column chunk must end before it
    return meta


def plan_columns(meta: dict[int, Any], names: Sequence[str], allowed: Sequence[set[int]]) -> Plan:
    """The plan to decode columns ``names`` of the file whose footer is ``meta``.

    Args:
        meta: :func:`read_footer`'s result.
        names: the columns, top-level.
        allowed: for each, the physical types the caller takes.

    Returns:
        The plan: each column's physical type, and per row group its rows and chunks (in ``names`` order).

    Raises:
        Unsupported: a column this reader does not decode, with the reason.

    >>> plan_columns({-1: 100, 2: [{4: "schema", 5: 0}], 4: []}, ["x"], [{INT64}])
    Traceback (most recent call last):
    ...
    gradagg.formats._parquet_meta.Unsupported: no top-level column 'x'
    """
    leaves = _top_level_leaves(meta.get(2))
    arrow = _arrow_types(meta.get(5))
    types, optional, positions = [], [], []
    for name, kinds in zip(names, allowed):
        if name not in leaves:
            raise Unsupported(f"no top-level column {name!r}")
        position, element = leaves[name]
        types.append(_plain_type(name, element, kinds, arrow))
        optional.append(element.get(3) == _OPTIONAL)
        positions.append(position)
    groups = []
    for k, group in enumerate(_list(meta.get(4))):
        rows, columns = _group(k, group)
        chunks = tuple(_chunk(columns, at, name, t, opt, rows, meta[-1])
                       for at, name, t, opt in zip(positions, names, types, optional))
        groups.append((rows, chunks))
    return Plan(tuple(types), groups)


def _top_level_leaves(schema: Any) -> dict[str, tuple[int, dict[int, Any]]]:
    """Each top-level primitive column by name: (its leaf position, its SchemaElement); groups are skipped."""
    elements = _list(schema)
    if not elements or not isinstance(elements[0], dict):
        raise Unsupported("the footer has no schema")
    leaves: dict[str, tuple[int, dict[int, Any]]] = {}
    seen: set[str] = set()
    at, leaf = 1, 0
    for _ in range(_int(elements[0].get(5, 0))):
        if at >= len(elements) or not isinstance(elements[at], dict):
            raise Unsupported("the schema is cut short")
        element = elements[at]
        name = _name(element)
        end, count = _subtree_end(elements, at)
        if name in seen:
            leaves.pop(name, None)  # two top-level columns of one name: neither is plain
        elif count == 1 and end == at + 1:
            leaves[name] = (leaf, element)
        seen.add(name)
        at, leaf = end, leaf + count
    return leaves


def _subtree_end(elements: list[Any], at: int) -> tuple[int, int]:
    """The index after the subtree of ``elements[at]`` and its number of leaves (without recursion)."""
    pending, leaves = 1, 0
    while pending:
        if at >= len(elements) or not isinstance(elements[at], dict):
            raise Unsupported("the schema is cut short")
        children = _int(elements[at].get(5, 0))
        pending += children - 1
        leaves += children == 0
        at += 1
    return at, leaves


def _plain_type(name: str, element: dict[int, Any], kinds: set[int], arrow: dict[str, str] | None) -> int:
    ptype = element.get(1)
    if ptype not in kinds:
        raise Unsupported(f"column {name!r} has physical type {ptype}")
    if element.get(3) not in (_REQUIRED, _OPTIONAL):
        raise Unsupported(f"column {name!r} is repeated")
    converted = element.get(6)
    if converted is not None and converted != _SIGNED_INT_CONVERTED.get(ptype):
        raise Unsupported(f"column {name!r} has converted type {converted}")
    logical = element.get(10)
    if logical is not None and not _signed_int(logical, ptype):
        raise Unsupported(f"column {name!r} has a logical type {logical}")
    if arrow is not None and arrow.get(name) != TYPE_NAMES[ptype]:
        raise Unsupported(f"column {name!r} is {arrow.get(name)} in the file's Arrow schema")
    return int(ptype)


def _signed_int(logical: Any, ptype: int) -> bool:
    integer = logical.get(_INTEGER_LOGICAL) if isinstance(logical, dict) and len(logical) == 1 else None
    width = {INT32: 32, INT64: 64}.get(ptype)
    return isinstance(integer, dict) and integer.get(1) == width and integer.get(2) is True


def _arrow_types(key_values: Any) -> dict[str, str] | None:
    """The Arrow schema's plain types by column, if pyarrow wrote one; None if there is none."""
    for kv in _list(key_values):
        if isinstance(kv, dict) and kv.get(1) == b"ARROW:schema":
            types = _arrow_schema.plain_types(kv.get(2) or b"")
            if types is None:
                raise Unsupported("the file's Arrow schema does not decode")
            return types
    return None


def _group(k: int, group: Any) -> tuple[int, list[Any]]:
    if not isinstance(group, dict):
        raise Unsupported(f"row group {k} does not decode")
    rows = _int(group.get(3))
    if not 0 <= rows <= MAX_GROUP_ROWS:
        raise Unsupported(f"row group {k} has {rows} rows (decoded at once only up to {MAX_GROUP_ROWS})")
    return rows, _list(group.get(1))


def _chunk(columns: list[Any], at: int, name: str, ptype: int, optional: bool, rows: int, end: int) -> Chunk:
    column = _dict(columns[at] if at < len(columns) else None)
    meta = column.get(3)
    if not isinstance(meta, dict) or any(k in column for k in (1, 8, 9)):  # elsewhere, or encrypted
        raise Unsupported(f"column {name!r}: a chunk in another file, encrypted, or without metadata")
    if meta.get(1) != ptype or meta.get(3) != [name.encode()] or meta.get(5) != rows:
        raise Unsupported(f"column {name!r}: a chunk whose type, path or value count differs from the schema")
    if meta.get(4) not in _CODECS or not set(_list(meta.get(2))) <= _ENCODINGS:
        raise Unsupported(f"column {name!r}: codec {meta.get(4)} or encodings {meta.get(2)}")
    if rows == 0:  # nothing to read (writers put such chunks at offset 0, without statistics)
        return Chunk(0, 0, ptype, int(meta[4]), int(optional))
    if optional and _int(_dict(meta.get(12)).get(3, -1)) != 0:
        raise Unsupported(f"column {name!r} is OPTIONAL and its statistics do not say it holds no null")
    data, dictionary = _int(meta.get(9)), _int(meta.get(11, 0))
    start = dictionary if 0 < dictionary < data else data
    length = _int(meta.get(7))
    if start < 4 or length < 0 or start + length > end:
        raise Unsupported(f"column {name!r}: a chunk outside the file's data")
    if length > 64 * rows + (1 << 20):  # 8 bytes a value and page headers: more is no file this reader is for
        raise Unsupported(f"column {name!r}: a chunk of {length} bytes for {rows} rows")
    return Chunk(start, length, ptype, int(meta[4]), int(optional))


def _list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _dict(x: Any) -> dict[int, Any]:
    return x if isinstance(x, dict) else {}


def _int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise Unsupported(f"a footer field holds {type(x).__name__} where an integer belongs")
    return x


def _name(element: dict[int, Any]) -> str:
    name = element.get(4)
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else ""
