"""gradagg.formats._thrift: the compact-protocol decoder against an encoder, and against hostile bytes.

Every struct the encoder writes (tests/formats/parquet_files.py) decodes to what was encoded; every
prefix of it, and any byte string at all, decodes or raises ThriftError: never another exception,
never a long loop (a length claims no more than the bytes there).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradagg.formats._thrift import ThriftError, read_struct
from tests.formats.parquet_files import encode_struct

FUZZ = settings(derandomize=True, deadline=None, max_examples=200)

scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.booleans(), st.binary(max_size=20),
    st.floats(allow_nan=False), st.sampled_from([0, -1, 1, 2**31, -(2**31)]),
)
field_ids = st.integers(1, 40)


def values(depth: int = 2) -> st.SearchStrategy[Any]:
    if depth == 0:
        return scalars
    inner = values(depth - 1)
    lists = st.one_of(*(st.lists(s, max_size=17) for s in (st.integers(-5, 2**40), st.binary(max_size=3),
                                                            st.booleans(), structs(depth - 1))))
    return st.one_of(scalars, lists, st.dictionaries(field_ids, inner, max_size=4))


def structs(depth: int) -> st.SearchStrategy[dict[int, Any]]:
    return st.dictionaries(field_ids, scalars if depth == 0 else values(depth - 1), max_size=5)


@FUZZ
@given(structs(3))
def test_decodes_what_was_encoded(fields: dict[int, Any]) -> None:
    """The decoder is the encoder's inverse: the same ids, ints, bools, bytes, doubles, lists and structs."""
    data = encode_struct(fields)
    assert read_struct(data + b"tail") == (fields, len(data))


@FUZZ
@given(structs(3), st.data())
def test_every_cut_is_a_thrift_error(fields: dict[int, Any], data: st.DataObject) -> None:
    """A struct cut anywhere before its end is incomplete: ThriftError, never IndexError or a wrong answer."""
    encoded = encode_struct(fields)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ThriftError):
        read_struct(encoded[:cut])


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_thrift_error(data: bytes) -> None:
    """Random bytes: a struct or ThriftError, and nothing else."""
    try:
        fields, end = read_struct(data)
    except ThriftError:
        return
    assert isinstance(fields, dict) and 0 < end <= len(data)


def test_lengths_beyond_the_bytes_and_deep_nesting_are_refused_quickly() -> None:
    """A list of 2**40 elements in 10 bytes, a binary of 2**30 bytes, structs 100 deep: refused, not tried."""
    huge_list = bytes([0x19, 0xFC]) + b"\xff\xff\xff\xff\x3f"  # field 1: list, 15+ elements of i64: 2**34 - 1
    with pytest.raises(ThriftError, match="only .* bytes left"):
        read_struct(huge_list)
    with pytest.raises(ThriftError, match="only .* bytes left"):
        read_struct(bytes([0x18]) + b"\x80\x80\x80\x80\x04")  # field 1: binary of 2**30 bytes
    with pytest.raises(ThriftError, match="nested"):
        read_struct(bytes([0x1C]) * 100 + bytes(100))
    with pytest.raises(ThriftError, match="64 bits"):
        read_struct(bytes([0x16]) + b"\xff" * 11)
