"""Thrift's compact protocol, encoding only: enough to write a Parquet footer and page headers.

The mirror of :mod:`gradagg.formats._thrift` (which only reads). The compact
protocol does not say a field's type by itself, so a struct is given as a list
of typed fields ``(field id, type, value)`` in ascending id order; a value of
None is left out (an absent optional field). Types and their values:

    I16, I32, I64  an int (a zigzag varint; the type in the field header must be the one the reader
                   expects: a reader skips a field of another type)
    BINARY         bytes, or a str (written as UTF-8)
    BOOL           a bool (in a struct's field header, as the protocol does)
    STRUCT         a list of typed fields
    LIST           ``(element type, [values])``; elements of an integer type, BINARY or STRUCT

Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

I16, I32, I64, BINARY, LIST, STRUCT = 4, 5, 6, 8, 9, 12  # the compact protocol's type ids
BOOL, _FALSE = 1, 2  # a bool field's header type is TRUE (1) or FALSE (2): the value picks which

Field = tuple[int, int, Any]
"""``(field id, type, value)``."""


def encode_struct(fields: Sequence[Field]) -> bytes:
    """The compact-protocol bytes of a struct.

    Args:
        fields: ``(id, type, value)`` in ascending id order; a None value is left out.

    Returns:
        The struct's bytes, its stop byte included.

    Raises:
        ValueError: ids not ascending, or a type this encoder does not write.

    >>> encode_struct([(1, I32, 2), (2, BINARY, b"hi"), (3, I64, None)]).hex()  # read_struct's example, back
    '15041802686900'
    """
    out = bytearray()
    _struct(out, fields)
    return bytes(out)


def _struct(out: bytearray, fields: Sequence[Field]) -> None:
    last = 0
    for fid, kind, value in fields:
        if value is None:
            continue
        if fid <= last:
            raise ValueError(f"field {fid} after field {last}: ids must ascend")
        head = (BOOL if value else _FALSE) if kind == BOOL else kind
        if fid - last <= 15:
            out.append((fid - last) << 4 | head)  # the short form: the id as a delta from the last one
        else:
            out.append(head)
            _varint(out, _zigzag(fid))
        if kind != BOOL:
            _value(out, kind, value)
        last = fid
    out.append(0)  # STOP


def _value(out: bytearray, kind: int, value: Any) -> None:
    if kind in (I16, I32, I64):
        _varint(out, _zigzag(int(value)))
    elif kind == BINARY:
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        _varint(out, len(data))
        out += data
    elif kind == STRUCT:
        _struct(out, value)
    elif kind == LIST:
        element, items = value
        if element not in (I16, I32, I64, BINARY, STRUCT):
            raise ValueError(f"a list of compact type {element} is not written here")
        if len(items) < 15:
            out.append(len(items) << 4 | element)
        else:
            out.append(0xF0 | element)
            _varint(out, len(items))
        for item in items:
            _value(out, element, item)
    else:
        raise ValueError(f"compact type {kind} is not written here")


def _zigzag(n: int) -> int:
    if not -(2**63) <= n < 2**63:
        raise ValueError(f"{n} is beyond the 64 bits of a thrift integer")
    return (n << 1) ^ (n >> 63)


def uleb128(n: int) -> bytes:
    """An unsigned varint (ULEB128), as thrift's compact protocol and Parquet's RLE run headers write it.

    >>> uleb128(300).hex()
    'ac02'
    """
    out = bytearray()
    _varint(out, n)
    return bytes(out)


def _varint(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
