"""Test helpers for the native Parquet reader: a Thrift compact *encoder*, and footers patched with it.

The encoder is the decoder's mirror (:mod:`gradagg.formats._thrift`): a struct is a
dict ``{field id: value}``; ints are written as i64 (the decoder reads every
integer width alike), bools as bools, bytes as binary, floats as doubles, lists
of one element type, dicts as structs. It lets a test write the footer a
writer would not (a null count of 0 over a null, a chunk cut short) and check
that the native reader refuses it cleanly.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradagg.formats import _thrift

I64, BINARY, DOUBLE, LIST, STRUCT, TRUE, FALSE = 6, 8, 7, 9, 12, 1, 2


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def zigzag(n: int) -> bytes:
    return varint((n << 1) ^ (n >> 63) if n < 0 else n << 1)


def kind(value: Any) -> int:
    if isinstance(value, bool):
        return TRUE if value else FALSE
    if isinstance(value, int):
        return I64
    if isinstance(value, bytes):
        return BINARY
    if isinstance(value, float):
        return DOUBLE
    if isinstance(value, list):
        return LIST
    if isinstance(value, dict):
        return STRUCT
    raise TypeError(f"cannot encode {type(value).__name__}")


def element(value: Any) -> bytes:
    """A value where its type is already known (a field's body, or a list element)."""
    if isinstance(value, bool):
        return bytes([TRUE if value else FALSE])
    if isinstance(value, int):
        return zigzag(value)
    if isinstance(value, bytes):
        return varint(len(value)) + value
    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, list):
        elem = kind(value[0]) if value else I64
        elem = TRUE if elem == FALSE else elem
        head = bytes([(len(value) << 4) | elem]) if len(value) < 15 else bytes([0xF0 | elem]) + varint(len(value))
        return head + b"".join(element(v) for v in value)
    return encode_struct(value)


def encode_struct(fields: dict[int, Any]) -> bytes:
    """The compact encoding of a struct (field ids ascending, as writers emit them)."""
    out, last = bytearray(), 0
    for fid in sorted(k for k in fields if k >= 0):
        value = fields[fid]
        t = kind(value)
        if 0 < fid - last <= 15:
            out.append(((fid - last) << 4) | t)
        else:
            out.append(t)
            out += zigzag(fid)
        if t not in (TRUE, FALSE):  # a bool field's value is its type
            out += element(value)
        last = fid
    out.append(0)
    return bytes(out)


def read_footer(path: Path) -> tuple[bytes, dict[int, Any]]:
    """The file's bytes before its footer, and the footer decoded."""
    data = path.read_bytes()
    length = int.from_bytes(data[-8:-4], "little")
    meta, _ = _thrift.read_struct(data[-8 - length : -8])
    return data[: -8 - length], meta


def patch_footer(path: Path, out: Path, change: Callable[[dict[int, Any]], None]) -> Path:
    """Write ``out``: ``path`` with its footer decoded, changed in place by ``change``, and encoded again."""
    body, meta = read_footer(path)
    change(meta)
    footer = encode_struct(meta)
    out.write_bytes(body + footer + len(footer).to_bytes(4, "little") + b"PAR1")
    return out


def chunks(meta: dict[int, Any]) -> list[dict[int, Any]]:
    """Every column chunk's ColumnMetaData, row group by row group."""
    return [column[3] for group in meta[4] for column in group[1]]
