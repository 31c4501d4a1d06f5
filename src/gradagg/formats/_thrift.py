"""Thrift's compact protocol, decoding only: enough to read a Parquet footer (``FileMetaData``).

A struct decodes to a dict ``{field id: value}`` (the caller names the fields
it needs, from ``parquet.thrift``); a list or set to a list, a map to a dict,
binary to bytes, integers to ints, a bool to a bool. Standard library only.

The input is untrusted (a file's footer): every length is checked against the
bytes actually there before it is used, a list cannot claim more elements than
bytes remain (each takes one at least), and nesting is bounded, so a corrupt or
hostile footer raises :class:`ThriftError` quickly instead of allocating or
recursing without end.
"""

from __future__ import annotations

from struct import unpack_from
from typing import Any

_MAX_DEPTH = 32  # Parquet's footer nests 5 deep; a deeper one is refused rather than recursed into
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class ThriftError(ValueError):
    """Bytes that are not a well-formed compact-protocol struct (cut short, a bad type, too deep)."""


def read_struct(data: bytes, pos: int = 0) -> tuple[dict[int, Any], int]:
    """Decode the struct that starts at ``data[pos]``.

    Args:
        data: the bytes (a Parquet footer, say).
        pos: where the struct starts.

    Returns:
        ``(fields, end)``: the struct's fields by id, and the position just after it.

    Raises:
        ThriftError: the bytes are not a complete, well-formed struct.

    >>> read_struct(bytes([0x15, 0x04, 0x18, 0x02, 0x68, 0x69, 0x00]))  # field 1: i32 2; field 2: b"hi"
    ({1: 2, 2: b'hi'}, 7)
    """
    reader = _Reader(data, pos)
    try:
        fields = reader.struct(0)
    except IndexError:
        raise ThriftError(f"the struct at byte {pos} is cut short") from None
    return fields, reader.pos


class _Reader:
    def __init__(self, data: bytes, pos: int) -> None:
        self.data, self.pos = data, pos

    def varint(self) -> int:
        data, pos, shift, value = self.data, self.pos, 0, 0
        while True:
            byte = data[pos]  # IndexError at the end: reported as cut short
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                self.pos = pos
                return value
            shift += 7
            if shift > 63:
                raise ThriftError(f"a varint longer than 64 bits at byte {self.pos}")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def struct(self, depth: int) -> dict[int, Any]:
        if depth > _MAX_DEPTH:
            raise ThriftError(f"structs nested more than {_MAX_DEPTH} deep")
        fields: dict[int, Any] = {}
        last = 0
        while True:
            head = self.data[self.pos]
            self.pos += 1
            if head == 0:
                return fields
            kind, delta = head & 0x0F, head >> 4
            last = last + delta if delta else self.zigzag()
            fields[last] = kind == _BOOL_TRUE if kind in (_BOOL_TRUE, _BOOL_FALSE) else self.value(kind, depth)

    def value(self, kind: int, depth: int) -> Any:
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _BINARY:
            return self.binary()
        if kind == _STRUCT:
            return self.struct(depth + 1)
        if kind in (_LIST, _SET):
            return self.list(depth)
        if kind == _BYTE:
            self.pos += 1
            return self.data[self.pos - 1] - (256 if self.data[self.pos - 1] > 127 else 0)
        if kind == _DOUBLE:
            self._need(8)
            self.pos += 8
            return unpack_from("<d", self.data, self.pos - 8)[0]
        if kind in (_BOOL_TRUE, _BOOL_FALSE):  # an element of a list or map: a byte of its own
            self.pos += 1
            return self.data[self.pos - 1] == _BOOL_TRUE
        if kind == _MAP:
            return self.map(depth)
        raise ThriftError(f"unknown compact type {kind} at byte {self.pos}")

    def binary(self) -> bytes:
        n = self.varint()
        self._need(n)
        self.pos += n
        return bytes(self.data[self.pos - n : self.pos])

    def list(self, depth: int) -> list[Any]:
        head = self.data[self.pos]
        self.pos += 1
        n, kind = head >> 4, head & 0x0F
        if n == 15:
            n = self.varint()
        self._need(n)  # every element takes a byte at least
        return [self.value(kind, depth + 1) for _ in range(n)]

    def map(self, depth: int) -> dict[Any, Any]:
        n = self.varint()
        if n == 0:
            return {}
        self._need(2 * n)
        kinds = self.data[self.pos]
        self.pos += 1
        out: dict[Any, Any] = {}
        for _ in range(n):
            key = self.value(kinds >> 4, depth + 1)
            out[key if not isinstance(key, (dict, list)) else repr(key)] = self.value(kinds & 0x0F, depth + 1)
        return out

    def _need(self, n: int) -> None:
        if n > len(self.data) - self.pos:
            raise ThriftError(f"a length of {n} at byte {self.pos}, only {len(self.data) - self.pos} bytes left")
