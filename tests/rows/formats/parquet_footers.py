"""Parquet footers rewritten as a writer would not write them, to check that the reader refuses them.

A small Thrift compact-protocol codec for tests only (the package reads
Parquet with pyarrow alone): a struct decodes to ``{field id: (type, value)}``,
a list to ``(element type, [values])``, so that encoding it again gives the
same bytes, wire types and all; a test changes a field in between
(:func:`patch_footer`). Input is trusted: files pyarrow just wrote.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(1, 13)
Struct = dict[int, tuple[int, Any]]


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return value

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def struct(self) -> Struct:
        fields: Struct = {}
        last = 0
        while (head := self.byte()) != 0:
            t, delta = head & 0x0F, head >> 4
            last = last + delta if delta else self.zigzag()
            fields[last] = (t, t == TRUE) if t in (TRUE, FALSE) else (t, self.value(t))
        return fields

    def value(self, t: int) -> Any:
        if t in (I16, I32, I64):
            return self.zigzag()
        if t == BINARY:
            n = self.varint()
            self.pos += n
            return self.data[self.pos - n : self.pos]
        if t == STRUCT:
            return self.struct()
        if t in (LIST, SET):
            head = self.byte()
            n, elem = head >> 4, head & 0x0F
            n = self.varint() if n == 15 else n
            return (elem, [self.value(elem) for _ in range(n)])
        if t == BYTE:
            return self.byte()
        if t == DOUBLE:
            self.pos += 8
            return struct.unpack_from("<d", self.data, self.pos - 8)[0]
        if t in (TRUE, FALSE):
            return self.byte() == TRUE
        raise ValueError(f"compact type {t} is not used in Parquet footers")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _value(t: int, v: Any) -> bytes:
    if t in (I16, I32, I64):
        return _zigzag(v)
    if t == BINARY:
        return _varint(len(v)) + bytes(v)
    if t == STRUCT:
        return encode(v)
    if t in (LIST, SET):
        elem, items = v
        head = bytes([(len(items) << 4) | elem]) if len(items) < 15 else bytes([0xF0 | elem]) + _varint(len(items))
        return head + b"".join(_value(elem, x) for x in items)
    if t == BYTE:
        return bytes([v])
    if t == DOUBLE:
        return struct.pack("<d", v)
    return bytes([TRUE if v else FALSE])  # a bool as a list element


def encode(fields: Struct) -> bytes:
    """A struct in the compact protocol (field ids ascending, as writers emit them)."""
    out, last = bytearray(), 0
    for fid in sorted(fields):
        t, v = fields[fid]
        if t in (TRUE, FALSE):
            t = TRUE if v else FALSE
        out += bytes([((fid - last) << 4) | t]) if 0 < fid - last <= 15 else bytes([t]) + _zigzag(fid)
        if t not in (TRUE, FALSE):  # a bool field's value is its type
            out += _value(t, v)
        last = fid
    return bytes(out + b"\x00")


def patch_footer(path: Path, out: Path, change: Callable[[Struct], None]) -> Path:
    """Write ``out``: ``path`` with its FileMetaData decoded, changed in place by ``change``, encoded again."""
    data = path.read_bytes()
    length = int.from_bytes(data[-8:-4], "little")
    meta = _Reader(data[-8 - length : -8]).struct()
    change(meta)
    footer = encode(meta)
    out.write_bytes(data[: -8 - length] + footer + len(footer).to_bytes(4, "little") + b"PAR1")
    return out


def row_groups(meta: Struct) -> list[Struct]:
    """The footer's RowGroup structs (FileMetaData field 4)."""
    return list(meta[4][1][1])


def chunks(group: Struct) -> list[Struct]:
    """A row group's ColumnChunk structs (RowGroup field 1)."""
    return list(group[1][1][1])
