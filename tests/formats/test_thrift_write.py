"""gradagg.formats._thrift_write: the compact-protocol encoder against the decoder and the tests' own encoder.

Every typed struct encodes to bytes that :func:`gradagg.formats._thrift.read_struct` decodes to the same
fields, and, where the tests' untyped encoder (tests/formats/parquet_files.py, which writes every integer
as i64) can say the same struct, to its very bytes. What the encoder cannot write is a ValueError.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradagg.formats._thrift import read_struct
from gradagg.formats._thrift_write import BINARY, BOOL, I16, I32, I64, LIST, STRUCT, Field, encode_struct
from tests.formats.parquet_files import encode_struct as untyped_encode

FUZZ = settings(derandomize=True, deadline=None, max_examples=200)
INT64 = st.integers(-(2**63), 2**63 - 1)


def typed_values(depth: int) -> st.SearchStrategy[tuple[int, Any]]:
    """``(type, value)`` pairs; structs and lists down to ``depth`` levels."""
    scalars = st.one_of(
        st.tuples(st.sampled_from([I16, I32, I64]), st.one_of(INT64, st.sampled_from([0, -1, 2**31, -(2**31)]))),
        st.tuples(st.just(BINARY), st.one_of(st.binary(max_size=20), st.text(max_size=5))),
        st.tuples(st.just(BOOL), st.booleans()),
    )
    if depth == 0:
        return scalars
    lists = st.one_of(
        st.tuples(st.just(LIST), st.tuples(st.just(I64), st.lists(INT64, max_size=20))),
        st.tuples(st.just(LIST), st.tuples(st.just(BINARY), st.lists(st.binary(max_size=3), max_size=17))),
        st.tuples(st.just(LIST), st.tuples(st.just(STRUCT), st.lists(structs(depth - 1), max_size=3))),
    )
    return st.one_of(scalars, lists, st.tuples(st.just(STRUCT), structs(depth - 1)))


def structs(depth: int) -> st.SearchStrategy[list[Field]]:
    """Typed fields with ascending ids: short deltas and long ones (> 15, the long field header)."""
    by_id = st.dictionaries(st.integers(1, 40), typed_values(depth), max_size=5)
    return by_id.map(lambda d: [(fid, kind, value) for fid, (kind, value) in sorted(d.items())])


def decoded(kind: int, value: Any) -> Any:
    """What the decoder gives back for a typed value: ints, bytes, bools, lists, dicts by field id."""
    if kind == STRUCT:
        return {fid: decoded(k, v) for fid, k, v in value}
    if kind == LIST:
        element, items = value
        return [decoded(element, item) for item in items]
    if kind == BINARY and isinstance(value, str):
        return value.encode("utf-8")
    return value


def untyped(kind: int, value: Any) -> Any:
    """The same value for the tests' untyped encoder (dicts for structs), or None where it writes another type."""
    if kind == STRUCT:
        fields = {fid: untyped(k, v) for fid, k, v in value}
        return None if any(v is None for v in fields.values()) else fields
    if kind == LIST:
        element, items = value
        if element != I64 or not items:  # it takes a list's element type from the first element, i64 for none
            return None if element != I64 else []
        return [untyped(element, item) for item in items]
    if kind in (I16, I32) or (kind == BINARY and isinstance(value, str)):
        return None
    return value


@FUZZ
@given(structs(2))
def test_what_is_encoded_decodes_back(fields: list[Field]) -> None:
    """read_struct(encode_struct(fields)) is the fields, and ends exactly at the end of the bytes."""
    data = encode_struct(fields)
    assert read_struct(data) == (decoded(STRUCT, fields), len(data))
    same = untyped(STRUCT, fields)
    if same is not None:
        assert data == untyped_encode(same)


def test_a_parquet_page_header_byte_for_byte() -> None:
    """A PageHeader for 3 PLAIN values with definition levels (34 bytes), by hand: field headers are
    (id delta << 4) | type (0x15 an i32, 0x2c a struct), ints zigzag varints (34 -> 0x44), 0x00 ends a struct."""
    header = encode_struct([(1, I32, 0), (2, I32, 34), (3, I32, 34),
                            (5, STRUCT, [(1, I32, 3), (2, I32, 0), (3, I32, 3), (4, I32, 3)])])
    assert header.hex() == "15001544" "1544" "2c" "1506150015061506" "00" "00"


def test_none_is_an_absent_field_and_long_ids_use_the_long_header() -> None:
    """Field 1 absent, field 20 (delta 20 > 15): the type byte, then the id as a zigzag varint (40 = 0x28)."""
    assert encode_struct([(1, I32, None), (20, I64, 1)]) == bytes([0x06, 0x28, 0x02, 0x00])
    assert encode_struct([(1, BOOL, True), (2, BOOL, False)]) == bytes([0x11, 0x12, 0x00])


@pytest.mark.parametrize("fields, fragment", [
    ([(2, I32, 1), (1, I32, 1)], "ids must ascend"),
    ([(1, I32, 1), (1, I32, 1)], "ids must ascend"),
    ([(1, I64, 2**63)], "beyond the 64 bits"),
    ([(1, I64, -(2**63) - 1)], "beyond the 64 bits"),
    ([(1, 7, 1.5)], "compact type 7"),  # a double: Parquet's footer needs none
    ([(1, LIST, (BOOL, [True]))], "a list of compact type 1"),
])
def test_what_it_does_not_write_is_a_value_error(fields: list[Field], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        encode_struct(fields)
