"""Arrow input: tables and record batches turned into NumPy columns without needless copies.

An owner-sum table has columns ``shard_id``, ``worker_id``, ``owner_id``
(integers or strings) and ``gradient`` (integers or floats, or a fixed-size
list of them for vector gradients). A microbatch table has one column per
microbatch, P rows each, a null marking an absent value. Numeric columns are
wrapped zero-copy; strings become NumPy ``<U`` arrays. ``Array.to_numpy`` is
called per chunk, because ``ChunkedArray.to_numpy`` may import pandas.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray

from gradagg.errors import FormatError, GradientShapeError, GradientTypeError, IdError

Array = NDArray[Any]
OWNER_COLUMNS = ("shard_id", "worker_id", "owner_id", "gradient")


def owner_columns(table: Any) -> Iterator[tuple[Array, Array, Array, Array]]:
    """Yield ``(shards, workers, owners, gradients)`` NumPy columns, one tuple per record batch."""
    missing = [c for c in OWNER_COLUMNS if c not in table.schema.names]
    if missing:
        raise FormatError(
            f"Arrow table lacks column(s) {', '.join(missing)}; expected {', '.join(OWNER_COLUMNS)} "
            f"(has {', '.join(table.schema.names)})"
        )
    batches = table.to_batches() if isinstance(table, pa.Table) else [table]
    offset = 0
    for batch in batches:
        ids = tuple(_ids(batch.column(name), name, offset) for name in OWNER_COLUMNS[:3])
        yield ids[0], ids[1], ids[2], _gradients(batch.column("gradient"), offset)
        offset += batch.num_rows


def microbatch_columns(table: Any) -> tuple[Array, Array]:
    """Return ``(values, present)``, both ``(M, P)``, from a table of M microbatch columns."""
    columns = [_combined(table.column(i)) for i in range(table.num_columns)]
    p = len(columns[0]) if columns else 0
    values = np.empty((len(columns), p), dtype=np.float64)
    present = np.empty((len(columns), p), dtype=bool)
    for i, col in enumerate(columns):
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise GradientTypeError(f"microbatch column {table.schema.names[i]!r} must be numeric, got {col.type}")
        present[i] = col.is_valid().to_numpy(zero_copy_only=False)
        values[i] = col.fill_null(0).to_numpy(zero_copy_only=False)
    return values, present


def _combined(col: Any) -> Any:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _first_null(arr: Any) -> int:
    return int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])


def _ids(arr: Any, name: str, offset: int) -> Array:
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if arr.null_count:
        raise IdError(f"row {offset + _first_null(arr)}: {name} is missing (null); every row needs an id")
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return _strings(arr)
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def _strings(arr: Any) -> Array:
    """A ``<U`` array of an Arrow string array: via NUL-padded fixed-width bytes when all ASCII."""
    if len(arr) == 0:
        return np.empty(0, dtype="<U1")
    width = max(1, int(pc.max(pc.binary_length(arr)).as_py()))
    if pc.all(pc.string_is_ascii(arr)).as_py():
        padded = pc.utf8_rpad(arr, width=width, padding="\x00")
        data = padded.buffers()[2]
        start = padded.offset * width
        fixed = np.frombuffer(data, dtype=f"S{width}", count=len(arr), offset=start)
        return fixed.astype(f"<U{width}")
    return np.array(arr.to_pylist(), dtype=str)


def _gradients(arr: Any, offset: int) -> Array:
    if arr.null_count:
        raise GradientTypeError(f"row {offset + _first_null(arr)}: gradient is missing (null)")
    if pa.types.is_fixed_size_list(arr.type) or pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        return _vectors(arr, offset)
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def _vectors(arr: Any, offset: int) -> Array:
    """``(N, D)`` from a list column; every list must have the same length D."""
    n = len(arr)
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
    else:
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        width = int(lengths[0]) if n else 0
        if n and (lengths != width).any():
            r = int(np.flatnonzero(lengths != width)[0])
            raise GradientShapeError(
                f"row {offset + r}: gradient is a vector of length {int(lengths[r])}, expected {width} "
                f"(from row {offset})"
            )
    values = arr.flatten()
    if values.null_count:
        raise GradientTypeError(f"row {offset + _first_null(arr.flatten()) // max(1, width)}: gradient element is null")
    return np.asarray(values.to_numpy(zero_copy_only=False)).reshape(n, width)
