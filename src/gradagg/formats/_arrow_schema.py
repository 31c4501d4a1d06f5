"""What Arrow type a Parquet file's ``ARROW:schema`` gives each column: read without pyarrow.

pyarrow writes the Arrow schema into the footer's key-value metadata (base64 of
an IPC schema message, a flatbuffer) and restores the types from it on reading:
an INT64 column may come back as a duration, or as a dictionary of int64. A
reader that does not use pyarrow must know when that happens, to give the file
to pyarrow instead of reading the plain integers. This module reads just enough
of the flatbuffer (the top-level fields: name, type, dictionary, extension
name) and is conservative: anything it cannot read says "unknown".

Flatbuffer layout (flatbuffers.dev "internals"): a table starts with an int32
back to its vtable (uint16 sizes, then one uint16 offset per field, 0 = absent,
i.e. the default); references (tables, vectors, strings) are uint32 offsets
from where they are stored. Arrow's ``Schema.fbs``: Message {version,
header_type, header}, Schema {endianness, fields}, Field {name, nullable,
type_type, type, dictionary, children, custom_metadata}, Int {bitWidth,
is_signed}, FloatingPoint {precision}.
"""

from __future__ import annotations

import binascii
from struct import error as StructError
from struct import unpack_from

INT, FLOAT = 2, 3  # Arrow's Type union tags
_SCHEMA_HEADER = 1  # MessageHeader.Schema
_SINGLE, _DOUBLE = 1, 2  # FloatingPoint.precision
_EXTENSION_KEY = b"ARROW:extension:name"


def plain_types(encoded: bytes) -> dict[str, str] | None:
    """Each top-level field's type as ``"int32"``, ``"int64"``, ``"float32"``, ``"float64"`` or ``"other"``.

    "other" is anything else: another type, a dictionary, an extension type,
    an unsigned or narrower integer.

    Args:
        encoded: the ``ARROW:schema`` value (base64 of an IPC schema message).

    Returns:
        ``{name: type}``, or None if the value cannot be read (then nothing is known).

    >>> plain_types(b"not base64!") is None
    True
    """
    try:
        message = binascii.a2b_base64(encoded)
        return _Flatbuffer(_strip_prefix(message)).fields()
    except (binascii.Error, StructError, ValueError, IndexError, RecursionError):
        return None


def _strip_prefix(message: bytes) -> bytes:
    """The flatbuffer of an encapsulated IPC message: [0xFFFFFFFF] int32 length, then the flatbuffer."""
    at = 4 if message[:4] == b"\xff\xff\xff\xff" else 0
    (length,) = unpack_from("<i", message, at)
    if length < 0 or at + 4 + length > len(message):
        raise ValueError("a schema message of a wrong length")
    return message[at + 4 : at + 4 + length]


class _Flatbuffer:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def fields(self) -> dict[str, str]:
        root = self._ref(0)
        if self._scalar(root, 1, "B", 0) != _SCHEMA_HEADER:
            raise ValueError("not a schema message")
        schema = self._table_field(root, 2)
        out: dict[str, str] = {}
        for field in self._vector(self._field_pos(schema, 1)):
            name = self._string(self._field_pos(field, 0)).decode("utf-8", "replace")
            out[name] = "other" if name in out else self._type(field)  # a repeated name: not a plain column
        return out

    def _type(self, field: int) -> str:
        if self._field_pos(field, 4) or self._is_extension(field):  # a dictionary, or an extension type
            return "other"
        tag = self._scalar(field, 2, "B", 0)
        if tag == INT:
            typ = self._table_field(field, 3)
            width, signed = self._scalar(typ, 0, "<i", 0), self._scalar(typ, 1, "B", 0)
            return f"int{width}" if signed and width in (32, 64) else "other"
        if tag == FLOAT:
            precision = self._scalar(self._table_field(field, 3), 0, "<h", 0)
            return {_SINGLE: "float32", _DOUBLE: "float64"}.get(precision, "other")
        return "other"

    def _is_extension(self, field: int) -> bool:
        at = self._field_pos(field, 6)
        return at != 0 and any(self._string(self._field_pos(kv, 0)) == _EXTENSION_KEY for kv in self._vector(at))

    # --- the flatbuffer primitives: every read is bounds-checked by unpack_from (struct.error) -------------

    def _u32(self, at: int) -> int:
        if at < 0:
            raise ValueError("a negative position")
        return int(unpack_from("<I", self.data, at)[0])

    def _ref(self, at: int) -> int:
        """Follow the uint32 offset stored at ``at``."""
        return at + self._u32(at)

    def _field_pos(self, table: int, index: int) -> int:
        """Where field ``index`` of the table at ``table`` is stored, 0 if absent."""
        (back,) = unpack_from("<i", self.data, table)
        vtable = table - back
        if vtable < 0:
            raise ValueError("a vtable before the buffer")
        size = unpack_from("<H", self.data, vtable)[0]
        if 4 + 2 * index >= size:
            return 0
        offset = unpack_from("<H", self.data, vtable + 4 + 2 * index)[0]
        return table + offset if offset else 0

    def _scalar(self, table: int, index: int, fmt: str, default: int) -> int:
        at = self._field_pos(table, index)
        return int(unpack_from(fmt, self.data, at)[0]) if at else default

    def _table_field(self, table: int, index: int) -> int:
        at = self._field_pos(table, index)
        if not at:
            raise ValueError("a required table is absent")
        return self._ref(at)

    def _vector(self, at: int) -> list[int]:
        """The positions of the tables of the vector referenced at ``at`` (none if absent)."""
        if not at:
            return []
        start = self._ref(at)
        n = self._u32(start)
        if 4 * n > len(self.data):
            raise ValueError("a vector longer than the buffer")
        return [self._ref(start + 4 + 4 * k) for k in range(n)]

    def _string(self, at: int) -> bytes:
        if not at:
            return b""
        start = self._ref(at)
        n = self._u32(start)
        if start + 4 + n > len(self.data):
            raise ValueError("a string longer than the buffer")
        return self.data[start + 4 : start + 4 + n]
