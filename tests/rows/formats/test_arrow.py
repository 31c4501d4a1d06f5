"""gradagg.rows.formats.arrow, the one Arrow adapter: what it reads (exactly, or refuses by name) and what it writes."""

from __future__ import annotations

from typing import Any

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")

from gradagg.errors import FormatError, GradaggError, GradientShapeError, IdError  # noqa: E402
from gradagg.rows.formats import arrow  # noqa: E402  (after the importorskips)


def batch(**columns: Any) -> Any:
    return pa.record_batch(list(columns.values()), names=list(columns))


def owner_batch(shards: Any, gradients: Any = None, n: int | None = None) -> Any:
    n = len(shards) if n is None else n
    grads = pa.array([1.0] * n) if gradients is None else gradients
    return batch(shard_id=shards, worker_id=pa.array([0] * n), owner_id=pa.array([0] * n), gradient=grads)


@pytest.mark.parametrize(
    ("column", "arrow_type", "expected"),
    [
        ("shard_id", pa.float64(), "column 'shard_id' has type double, expected an integer or string type"),
        ("worker_id", pa.bool_(), "column 'worker_id' has type bool, expected an integer or string type"),
        ("gradient", pa.string(), "column 'gradient' has type string, expected a float or integer type, or a list"),
        ("gradient", pa.list_(pa.string()), "column 'gradient' has type list<item: string>, expected a float"),
        ("owner_id", pa.string(), "column 'owner_id' has type string but 'worker_id' has type int64"),
    ],
)
def test_owner_schema_names_column_type_and_expected(column: str, arrow_type: Any, expected: str) -> None:
    fields = {"shard_id": pa.int64(), "worker_id": pa.int64(), "owner_id": pa.int64(), "gradient": pa.float64()}
    fields[column] = arrow_type
    with pytest.raises(FormatError, match=expected.replace("(", r"\(").replace("[", r"\[")):
        arrow.check_owner_schema(pa.schema(list(fields.items())))


def test_strings_keep_trailing_nuls_and_every_code_point() -> None:
    """Plain, large and dictionary strings become the Python strings themselves ('a' and 'a\\0' stay apart)."""
    ids = ["a", "a\x00", "", "\U0001f600", "é" * 100]
    for typed in (pa.array(ids), pa.array(ids, pa.large_string()), pa.array(ids).dictionary_encode()):
        both = owner_batch(typed, n=5).set_column(1, "worker_id", typed).set_column(2, "owner_id", typed)
        shards, workers, _, _ = arrow.OwnerBatches().columns(both)
        assert isinstance(shards, arrow.DictionaryIds) and shards.tolist() == ids
        assert shards.values.dtype == object and len(set(shards.values.tolist())) == 5  # each string once
        assert workers.dtype == object and workers.tolist() == ids


def test_a_growing_dictionary_is_decoded_once_per_string(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader hands each batch of a row group the dictionary so far: only its new tail is decoded."""
    decoded: list[int] = []
    python = arrow._Dictionary._python
    monkeypatch.setattr(arrow._Dictionary, "_python", lambda self, s, o: decoded.append(len(s)) or python(self, s, o))
    batches = arrow.OwnerBatches()
    first = pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array(["x", "y"]))
    second = pa.DictionaryArray.from_arrays(pa.array([2, 0], pa.int32()), pa.array(["x", "y", "z"]))
    assert batches.columns(owner_batch(first))[0].tolist() == ["x", "y"]
    assert batches.columns(owner_batch(second))[0].tolist() == ["z", "x"]
    assert decoded == [2, 1]  # "x", "y", then only "z"


def test_invalid_utf8_in_a_string_column_is_a_format_error() -> None:
    """A file can hold bytes that are not UTF-8 in a string column: named, not a UnicodeDecodeError."""
    bad = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(np.array([0, 1], np.int32)), pa.py_buffer(b"\xff")])
    with pytest.raises(FormatError, match="column 'shard_id' holds a string that is not valid UTF-8"):
        arrow.OwnerBatches().columns(owner_batch(bad))


def test_nulls_are_named_by_row_across_batches() -> None:
    batches = arrow.OwnerBatches()
    batches.columns(owner_batch(pa.array([1, 2])))
    with pytest.raises(IdError, match="row 3: shard_id is null"):
        batches.columns(owner_batch(pa.array([1, None])))
    with pytest.raises(GradaggError, match="row 2: gradient element 1 is null"):  # (the refused batch not counted)
        batches.columns(owner_batch(pa.array([1]), pa.array([[1.0, None]], pa.list_(pa.float64(), 2))))


def test_vector_gradients_fixed_and_variable_lists() -> None:
    """Fixed-size lists and lists of one length become (N, D) views; lists of two lengths are refused by row."""
    fixed = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], pa.list_(pa.float32(), 2)).slice(1)
    assert arrow.OwnerBatches().columns(owner_batch(pa.array([1, 2]), fixed))[3].tolist() == [[3, 4], [5, 6]]
    same = pa.array([[1.0], [2.0], [3.0]]).slice(1)
    assert arrow.OwnerBatches().columns(owner_batch(pa.array([1, 2]), same))[3].tolist() == [[2.0], [3.0]]
    with pytest.raises(GradientShapeError, match="row 1: gradient is a vector of length 2, expected 1"):
        arrow.OwnerBatches().columns(owner_batch(pa.array([1, 2]), pa.array([[1.0], [2.0, 3.0]])))


def test_numbers_are_viewed_not_copied() -> None:
    data = pa.array(np.arange(10, dtype=np.int64)).slice(3, 4)
    view = arrow.numeric(data)
    assert view.tolist() == [3, 4, 5, 6] and not view.flags.owndata


def test_microbatch_columns_nulls_are_absent_with_zero_beneath() -> None:
    """A null is present=False and holds 0 (its slot's buffer holds anything); ints stay ints; kinds do not mix."""
    values, present = arrow.microbatch_columns(pa.table({"m0": pa.array([2, None, 5]), "m1": pa.array([1, 2, 3])}))
    assert values.dtype == np.int64 and values.tolist() == [[2, 0, 5], [1, 2, 3]]
    assert present.tolist() == [[True, False, True], [True, True, True]]
    with pytest.raises(FormatError, match="'m0' has type int64 but 'm1' has type double"):
        arrow.microbatch_columns(pa.table({"m0": pa.array([1]), "m1": pa.array([1.5])}))


def test_writers_keep_values_exact() -> None:
    assert arrow.numbers_to_arrow(np.array([2**63 - 1, -(2**63)])).to_pylist() == [2**63 - 1, -(2**63)]
    assert arrow.numbers_to_arrow(np.array([[-0.0, 1.5]])).type == pa.list_(pa.float64(), 2)
    assert arrow.strings_to_arrow(["a\x00", ""]).to_pylist() == ["a\x00", ""]
    with pytest.raises(FormatError, match=r"shard id '\\ud800' holds surrogates not allowed .a lone surrogate"):
        arrow.strings_to_arrow(["\ud800"])


def test_an_adapter_made_from_a_schema_checks_it_and_knows_its_strings() -> None:
    good = pa.schema([("shard_id", pa.string()), ("worker_id", pa.int32()), ("owner_id", pa.int64()),
                      ("gradient", pa.list_(pa.float64(), 3))])
    adapter = arrow.OwnerBatches(good, "f.parquet")
    assert adapter.strings == ["shard_id"] and adapter.row_bytes == 24 + 8 * 3
    bad = pa.schema([("shard_id", pa.float64()), ("worker_id", pa.int32()), ("owner_id", pa.int64()),
                     ("gradient", pa.float64())])
    with pytest.raises(FormatError, match="f.parquet: column 'shard_id' has type double"):
        arrow.OwnerBatches(bad, "f.parquet")
