"""The one Arrow adapter: record batches to NumPy columns for the engine, and NumPy results back to Arrow arrays.

Reading: numeric columns become NumPy views of the Arrow buffers (no copy);
string ids are decoded once per distinct string through the column's
dictionary, into Python strings (``<U`` arrays would merge ``"a"`` and
``"a\\0"``): shard ids as :class:`DictionaryIds`, worker and owner ids as object
arrays. Nothing here applies a contract: replicas, NaN and the
id order are the engine's. What NumPy columns cannot say is refused here with
the row: a null id or gradient (absence has no meaning in owner-sum), or a type
the engines do not take.

Writing: NumPy arrays become Arrow arrays through their buffers. pyarrow 26's
own constructors (``pa.array``, ``Array.to_numpy``, ``pa.table`` from lists)
import pandas (a large share of a command's start-up), so neither direction
uses them; nor ``pyarrow.compute`` (an import of its own).

An owner-sum table has columns ``shard_id``, ``worker_id``, ``owner_id`` (integers
of any width, or strings: ``string``, ``large_string``, dictionary) and
``gradient`` (integers or floats, or a fixed-size or variable list of them of
one length D). A microbatch table has one numeric column per microbatch and
one row per parameter; a null is an absent value.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from gradagg.errors import FormatError, GradientShapeError, GradientTypeError, IdError, short_repr

Array = NDArray[Any]
OWNER_COLUMNS = ("shard_id", "worker_id", "owner_id", "gradient")


class OwnerSchema(NamedTuple):
    """What :func:`check_owner_schema` learnt from a schema (a NamedTuple: ``dataclasses`` is an import more).

    Attributes:
        shard_kind: ``"int"`` or ``"str"``.
        id_kind: ``"int"`` or ``"str"``: the kind of ``worker_id`` and ``owner_id``.
        dim: the vector length D of fixed-size list gradients, ``None`` for scalars (or variable lists).
    """

    shard_kind: str
    id_kind: str
    dim: int | None


def check_owner_schema(schema: pa.Schema, source: str = "input") -> OwnerSchema:
    """Check an owner-sum schema's columns and types before any row is read.

    Args:
        schema: the Arrow schema (of a table, or a Parquet file).
        source: the file name, for messages.

    Returns:
        The id kinds and the vector length of the gradients.

    Raises:
        FormatError: a missing column, or a column of a type the engines do not
            take; the message names the column, its type and the expected types.

    >>> check_owner_schema(pa.schema([("shard_id", pa.string()), ("worker_id", pa.int32()),
    ...                               ("owner_id", pa.int64()), ("gradient", pa.float64())]))
    OwnerSchema(shard_kind='str', id_kind='int', dim=None)
    >>> check_owner_schema(pa.schema([("shard_id", pa.float64()), ("worker_id", pa.int32()),
    ...                               ("owner_id", pa.int64()), ("gradient", pa.float64())]))
    Traceback (most recent call last):
    ...
    gradagg.errors.FormatError: input: column 'shard_id' has type double, expected an integer or string type
    """
    missing = [name for name in OWNER_COLUMNS if schema.get_field_index(name) < 0]
    if missing:
        raise FormatError(
            f"{source}: missing column(s) {', '.join(missing)}; owner-sum needs {', '.join(OWNER_COLUMNS)} "
            f"(found: {', '.join(schema.names) or 'no columns'})"
        )
    types = {name: schema.field(name).type for name in OWNER_COLUMNS}
    shard_kind = _id_kind(source, "shard_id", types["shard_id"])
    worker_kind = _id_kind(source, "worker_id", types["worker_id"])
    if _id_kind(source, "owner_id", types["owner_id"]) != worker_kind:
        # They are compared row by row: an int never equals a string, so every row would be a replica.
        raise FormatError(
            f"{source}: column 'owner_id' has type {types['owner_id']} but 'worker_id' has type "
            f"{types['worker_id']}; they are compared, so both must be integers or both strings"
        )
    return OwnerSchema(shard_kind, worker_kind, _gradient_dim(source, types["gradient"]))


def check_mean_schema(schema: pa.Schema, source: str = "input") -> int:
    """Check that every column is a numeric microbatch; return M, the column count (the divisor).

    Args:
        schema: the Arrow schema.
        source: the file name, for messages.

    Returns:
        M, the number of microbatches.

    Raises:
        FormatError: a column of another type, named with its type.

    >>> check_mean_schema(pa.schema([("mb0", pa.float64()), ("mb1", pa.float32())]))
    2
    """
    for field in schema:
        if not _is_number(field.type):
            raise FormatError(
                f"{source}: column {field.name!r} has type {field.type}, expected a float or integer type "
                "(the mean reads one column per microbatch, one row per parameter, null = absent)"
            )
    floats = [f for f in schema if pa.types.is_floating(f.type)]
    ints = [f for f in schema if pa.types.is_integer(f.type)]
    if floats and ints:  # one (M, P) array holds one kind; ints widened to float64 would lose exactness
        raise FormatError(
            f"{source}: column {ints[0].name!r} has type {ints[0].type} but {floats[0].name!r} has type "
            f"{floats[0].type}; the microbatch columns must be all floats or all integers"
        )
    return len(schema)


class DictionaryIds:
    """A string id column as NumPy: ``indices`` into ``values``, an object array of the distinct Python strings.

    What a dictionary-encoded Arrow column is, without a copy per row: the
    engines give each distinct string its code once and map the indices (per-row
    objects would cost a dict lookup per row; a ``<U`` array would merge ``"a"``
    and ``"a\\0"``). :meth:`tolist` gives the strings row by row.

    >>> DictionaryIds(np.array([1, 0, 1]), np.array(["a", "b"], dtype=object)).tolist()
    ['b', 'a', 'b']
    """

    __slots__ = ("indices", "values")

    def __init__(self, indices: Array, values: Array) -> None:
        self.indices, self.values = indices, values

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, rows: slice) -> DictionaryIds:
        return DictionaryIds(self.indices[rows], self.values)

    def tolist(self) -> list[Any]:
        """The ids row by row, as Python strings."""
        return self.values.take(self.indices).tolist()  # type: ignore[no-any-return]


class OwnerBatches:
    """Record batches of one owner-sum table or file to NumPy columns; rows numbered from the first batch.

    Keeps, per string column, the last dictionary and its decoded strings: a
    Parquet reader hands each batch of a row group the dictionary so far, so
    only its new tail is decoded.

    Args:
        schema: the table's or file's schema, checked here, before any row is read
            (:func:`check_owner_schema`); None: each batch's is checked as it comes.
        source: the file name, for messages.

    Attributes:
        strings: the id columns that hold strings (to be read as dictionaries).
        row_bytes: the bytes one row decodes to (three 8-byte ids and the gradient); 32 without a schema.

    Raises:
        FormatError: as :func:`check_owner_schema`.

    >>> batches = OwnerBatches()
    >>> batch = pa.record_batch([pa.array(["x"]), pa.array([1]), pa.array([1]), pa.array([0.5])], names=OWNER_COLUMNS)
    >>> [c.tolist() for c in batches.columns(batch)]
    [['x'], [1], [1], [0.5]]
    """

    def __init__(self, schema: pa.Schema | None = None, source: str = "input") -> None:
        self.rows = 0
        self._strings = [_Dictionary(name) for name in OWNER_COLUMNS[:3]]
        self.strings: list[str] = []
        self.row_bytes = 32
        if schema is not None:
            dim = check_owner_schema(schema, source).dim
            self.strings = [name for name in OWNER_COLUMNS[:3] if is_string(schema.field(name).type)]
            self.row_bytes = 24 + 8 * (dim or 1)

    def columns(self, batch: pa.RecordBatch) -> tuple[Any, Array, Array, Array]:
        """``(shard_ids, worker_ids, owner_ids, gradients)`` of one record batch.

        Raises:
            FormatError: a missing column, a column of a type the engines do not take.
            GradaggError: a null id or gradient, naming its row.
        """
        check_owner_schema(batch.schema)
        ids = [self._ids(batch.column(name), name, k) for k, name in enumerate(OWNER_COLUMNS[:3])]
        grads = _gradients(batch.column("gradient"), self.rows)
        self.rows += batch.num_rows
        return ids[0], ids[1], ids[2], grads

    def _ids(self, arr: Any, name: str, k: int) -> Any:
        if arr.null_count:
            raise IdError(f"row {self.rows + _first_null(arr)}: {name} is null; every row needs a shard, worker "
                          "and owner id")
        if is_string(arr.type):
            ids = self._strings[k].decode(arr, self.rows)
            # Shards are coded by the engine (once per distinct string); workers and owners are only compared,
            # row by row, where one object per row is what is needed.
            return ids if k == 0 else ids.values.take(ids.indices)
        return numeric(arr)


def owner_columns(table: Any) -> Iterator[tuple[Any, Array, Array, Array]]:
    """Yield ``(shard_ids, worker_ids, owner_ids, gradients)`` NumPy columns, one tuple per record batch.

    Args:
        table: a ``pyarrow.Table`` or ``RecordBatch`` with the owner-sum columns.

    Raises:
        FormatError: a missing column or a wrong type; GradaggError: a null, naming its row.
    """
    check_owner_schema(table.schema, "Arrow table")
    batches = OwnerBatches()
    for batch in table.to_batches() if isinstance(table, pa.Table) else [table]:
        yield batches.columns(batch)


def microbatch_columns(table: Any) -> tuple[Array, Array]:
    """Return ``(values, present)``, both ``(M, P)``, from a table or record batch of M microbatch columns.

    Values keep the columns' dtype when they share one (else float64); a null
    is ``present == False`` with a 0 beneath it (a null slot's buffer holds anything).

    Raises:
        FormatError: a column that is not numeric.
    """
    check_mean_schema(table.schema, "Arrow table")
    columns = [_combined(table.column(i)) for i in range(table.num_columns)]
    dtypes = {np.dtype(_numpy_type(c.type)) for c in columns}
    common = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float64 if dtypes.pop().kind == "f" else np.int64)
    values = np.empty((len(columns), len(table)), dtype=common)
    present = np.ones(values.shape, dtype=bool)
    for i, column in enumerate(columns):
        if column.null_count == len(column) and len(column):
            values[i], present[i] = 0, False  # an all-null column may have no data buffer at all
            continue
        data = numeric(column)
        if column.null_count:
            present[i] = _valid(column)
            data = np.where(present[i], data, 0)  # a null slot's buffer holds anything: keep it a harmless 0
        if data.dtype == np.uint64 and common != data.dtype and len(data) and int(data.max()) >= 2**63:
            raise GradientTypeError(f"microbatch column {i} holds {int(data.max())}, beyond int64")
        values[i] = data
    return values, present


# --- reading: Arrow arrays to NumPy ----------------------------------------------------------------


_NUMPY_TYPES = {
    pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
    pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
    pa.float16(): np.float16, pa.float32(): np.float32, pa.float64(): np.float64,
}  # the types whose data buffers NumPy can view as they are


def numeric(arr: Any) -> Array:
    """A NumPy view of a numeric Arrow array's data buffer: no copy (values under nulls are unspecified).

    >>> numeric(pa.array([1, 2, 3]).slice(1)).tolist()
    [2, 3]
    """
    arr = _combined(arr)
    dtype = np.dtype(_numpy_type(arr.type))
    data = arr.buffers()[1]
    if data is None:  # a zero-length array may come without a data buffer
        return np.zeros(len(arr), dtype=dtype)
    view: Array = np.frombuffer(data, dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)
    return view


class _Dictionary:
    """Decodes one string column through its dictionary: each distinct string once (and its tail, if it grew)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._last: tuple[Any, Array] | None = None  # a dictionary and its strings as an object array

    def decode(self, arr: Any, offset: int) -> DictionaryIds:
        if not pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_encode()  # a hash pass in C++, then one Python string per distinct id
        return DictionaryIds(numeric(arr.indices), self._strings(arr.dictionary, offset))

    def _strings(self, dictionary: Any, offset: int) -> Array:
        last = self._last
        if last is not None and len(dictionary) >= len(last[0]) and dictionary.slice(0, len(last[0])).equals(last[0]):
            tail = dictionary.slice(len(last[0]))
            strings = np.concatenate([last[1], self._python(tail, offset)]) if len(tail) else last[1]
        else:
            strings = self._python(dictionary, offset)
        self._last = (dictionary, strings)
        return strings

    def _python(self, strings: Any, offset: int) -> Array:
        try:
            values = strings.to_pylist()
        except UnicodeDecodeError as exc:  # a file may hold bytes that are not UTF-8 in a string column
            raise FormatError(
                f"rows from {offset}: column {self.name!r} holds a string that is not valid UTF-8 ({exc.reason})"
            ) from None
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out


def _gradients(arr: Any, offset: int) -> Array:
    if arr.null_count:
        raise GradientTypeError(f"row {offset + _first_null(arr)}: gradient is null; a row needs a number "
                                "(absence has no meaning in owner-sum)")
    if not _is_list(arr.type):
        return numeric(arr)
    arr = _combined(arr)
    n = len(arr)
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
    else:
        lengths = np.diff(numeric(arr.offsets))  # (pyarrow.compute would be an import more at start-up)
        width = int(lengths[0]) if n else 0
        if n and (lengths != width).any():
            r = int(np.flatnonzero(lengths != width)[0])
            raise GradientShapeError(f"row {offset + r}: gradient is a vector of length {int(lengths[r])}, expected "
                                     f"{width} (from row {offset}); the engines take one length D per batch")
    values = arr.flatten()  # the child values of these rows (flatten honours the slice offset)
    if values.null_count:
        r, k = divmod(_first_null(values), max(1, width))
        raise GradientTypeError(f"row {offset + r}: gradient element {k} is null")
    return numeric(values).reshape(n, width)


def _combined(arr: Any) -> Any:
    if isinstance(arr, pa.ChunkedArray):
        return arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return arr


def _valid(arr: Any) -> Array:
    """The validity bitmap as booleans (``is_valid().to_numpy()`` would import pandas)."""
    bits = np.unpackbits(np.frombuffer(arr.buffers()[0], dtype=np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


def _first_null(arr: Any) -> int:
    return int(np.argmin(_valid(arr)))


def _numpy_type(t: Any) -> Any:
    if t not in _NUMPY_TYPES:
        raise FormatError(f"column type {t} is not a number type the engines take")
    return _NUMPY_TYPES[t]


def _is_number(t: Any) -> bool:
    return t in _NUMPY_TYPES


def is_string(t: Any) -> bool:
    """Whether an Arrow type holds strings (``string``, ``large_string``, or a dictionary of them)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _is_list(t: Any) -> bool:
    return bool(pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t))


def _id_kind(source: str, name: str, t: Any) -> str:
    if pa.types.is_integer(t):
        return "int"
    if is_string(t):
        return "str"
    raise FormatError(f"{source}: column {name!r} has type {t}, expected an integer or string type")


def _gradient_dim(source: str, t: Any) -> int | None:
    if _is_number(t):
        return None
    if _is_list(t) and _is_number(t.value_type):
        return int(t.list_size) if pa.types.is_fixed_size_list(t) else None
    raise FormatError(
        f"{source}: column 'gradient' has type {t}, expected a float or integer type, or a list of them "
        "(fixed_size_list<float64>[D] for a vector gradient)"
    )


# --- writing: NumPy to Arrow arrays --------------------------------------------------------------------


def numbers_to_arrow(values: Array) -> Any:
    """An Arrow array over a 1-D or 2-D (fixed-size lists) NumPy int64/float64 array, through its buffer.

    >>> numbers_to_arrow(np.array([[1.0, 2.0]])).to_pylist()
    [[1.0, 2.0]]
    """
    values = np.ascontiguousarray(values)
    flat = values.reshape(-1)
    arr = pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), len(flat), [None, pa.py_buffer(flat)])
    return arr if values.ndim == 1 else pa.FixedSizeListArray.from_arrays(arr, int(values.shape[1]))


def strings_to_arrow(strings: Sequence[str]) -> Any:
    """A ``large_string`` Arrow array of Python strings (UTF-8 encoded; a lone surrogate cannot be).

    Raises:
        FormatError: a string that UTF-8 cannot encode, named.

    >>> strings_to_arrow(["a", "é"]).to_pylist()
    ['a', 'é']
    """
    encoded = []
    for s in strings:
        try:
            encoded.append(s.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise FormatError(
                f"cannot write Parquet: shard id {short_repr(s)} holds {exc.reason} "
                f"(a lone surrogate at index {exc.start}), "
                "which UTF-8 and so Parquet cannot hold; write JSON instead (-o FILE.json)"
            ) from None
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = pa.py_buffer(b"".join(encoded))
    return pa.Array.from_buffers(pa.large_string(), len(encoded), [None, pa.py_buffer(offsets), data])
