"""Parquet in and out: record batches read as NumPy columns (through :mod:`gradagg.formats.arrow`); results written.

Reading only: nothing here applies a contract (the engine drops replicas,
checks NaN and orders the shards; :func:`gradagg.engine.owner_sum_batches`
takes what :func:`owner_batches` yields). A file is read a row group at a time
(or ~8 MiB decoded at a time of a big one) on a thread of its own, the next
one decoding while the caller reduces this one, so memory stays bounded
however long the file is.

Owner-sum input schema (one row per gradient a worker reports for a shard)::

    column     type                                          meaning
    shard_id   an integer type | string                      the shard
    worker_id  an integer type | string                      the worker (rank) that produced the row
    owner_id   the kind of worker_id (integers or strings)   the shard's declared owner; the row counts
                                                             only when worker_id == owner_id
    gradient   a float or integer type                       a scalar gradient, or
               | fixed_size_list<float32 | float64>[D]       a vector of D elements

``string`` may also be ``large_string`` or dictionary-encoded. Other columns are
ignored. No nulls: a null id, gradient or vector element is an error naming its
row (rows count from 0 in file order, as in the other formats).

Microbatch-mean input schema (the layout that streams: P can be 10^7, M is a
handful): one numeric column per microbatch, in microbatch order, nullable (a
null cell = the parameter was absent); one row per parameter. The divisor M is
the number of columns; participation (non-null cells) is never a divisor. This
is the transpose of the CSV and JSON forms on purpose: each batch of parameter
rows holds every microbatch of those parameters, so it is complete in itself.

Output (``-o FILE.parquet``): owner-sum writes ``shard_id`` (int64 or
large_string) and ``total`` (float64, int64 for exact integer totals, or
fixed_size_list of them); the mean writes ``parameter`` (int64, from 0) and
``mean`` (float64). Nothing is ever rounded or re-encoded on the way: what a
Parquet column cannot hold exactly (an integer total beside float totals that
float64 would round, an integer beyond int64, a lone surrogate in a string id)
is an error naming it. The file appears all at once (temporary file, rename).
The native backend's results (``array.array`` columns) are written without
pyarrow by :mod:`gradagg.formats.parquet_native_write` instead (a file that
reads back the same); the command line chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gradagg.errors import FormatError, short_repr
from gradagg.formats import arrow
from gradagg.formats._readahead import read_ahead
from gradagg.formats.atomic import atomic_path

T = TypeVar("T")
Source = str | BinaryIO
"""A file's path, ``-`` for standard input, or a binary file object (standard input's bytes, say)."""
Progress = Callable[[int, int], None]
"""Called after each batch with (rows done, rows in the file)."""

OWNER_COLUMNS = arrow.OWNER_COLUMNS
_WHOLE_CHUNKS_UP_TO = 256 << 20  # row groups up to this many compressed bytes are read a column chunk at once
_BATCH_BYTES = 8 << 20  # decoded bytes per batch: large enough to amortise per-batch Python, small to bound memory
_EXACT = 2**53  # integers up to this magnitude are exact in float64


def owner_batches(path: Source, *, progress: Progress | None = None) -> Iterator[tuple[Any, Any, Any, Any]]:
    """The rows of an owner-sum Parquet file as ``(shard_ids, worker_ids, owner_ids, gradients)`` NumPy batches.

    Args:
        path: the file, ``-`` for standard input (held in memory), or a binary file object.
        progress: called after each batch with (rows done, rows in the file).

    Yields:
        Four NumPy columns per record batch (see :class:`gradagg.formats.arrow.OwnerBatches`).

    Raises:
        FormatError: not a Parquet file, a missing column or a column of the
            wrong type (named with its type and the expected ones), unreadable data.
        GradaggError: a null id or gradient, naming its row.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "rows.parquet")
    >>> pq.write_table(pa.table({"shard_id": [7], "worker_id": [1], "owner_id": [1], "gradient": [0.5]}), path)
    >>> [c.tolist() for c in next(owner_batches(path))]
    [[7], [1], [1], [0.5]]
    """
    pf = _open(path)
    schema = arrow.check_owner_schema(pf.schema_arrow, _source(path))
    strings = [name for name in OWNER_COLUMNS[:3] if arrow.is_string(pf.schema_arrow.field(name).type)]
    if strings:  # reopened so that strings arrive as small dictionaries plus indices: decoded once per distinct id
        pf = _open(path, read_dictionary=strings)
    row_bytes = 24 + 8 * (schema.dim or 1)  # three 8-byte ids and the gradient, as decoded
    yield from _batches(pf, path, list(OWNER_COLUMNS), row_bytes, arrow.OwnerBatches().columns, progress)


def microbatch_batches(path: Source, *, progress: Progress | None = None) -> Iterator[tuple[Any, Any]]:
    """The parameters of a mean Parquet file as ``(values, present)`` batches, both ``(M, p)``.

    Args:
        path: the file, ``-`` for standard input (held in memory), or a binary file object.
        progress: called after each batch with (parameters done, parameters in the file).

    Yields:
        Per record batch: the values of its p parameters in all M microbatches
        (row i = microbatch i = column i) and the mask, False where a cell is null.
        Nothing when the file has no column (M = 0: no microbatch at all).

    Raises:
        FormatError: not a Parquet file, or a column that is not numeric.
    """
    pf = _open(path)
    m = arrow.check_mean_schema(pf.schema_arrow, _source(path))
    if m == 0:
        return
    yield from _batches(pf, path, None, 9 * m, arrow.microbatch_columns, progress)  # 8 + 1 bytes a cell


# --- reading -----------------------------------------------------------------------------


def _open(path: Source, read_dictionary: list[str] | None = None) -> pq.ParquetFile:
    source: Any = path
    if not isinstance(path, str):
        path.seek(0)  # a file object is opened twice when its strings are read as dictionaries
    elif path == "-":
        source = pa.BufferReader(_stdin_bytes())  # Parquet's footer is at the end: it needs the whole file
    try:
        # pre_buffer=False: with pre-buffering, pyarrow keeps every buffered column chunk until the file is
        # closed (peak RSS 1.6 GB on 10^8 rows instead of 0.5 GB). No memory map: mapped pages count in the
        # resident size and stay there as the file is read.
        pf = pq.ParquetFile(source, pre_buffer=False, read_dictionary=read_dictionary)
        if _largest_row_group(pf) <= _WHOLE_CHUNKS_UP_TO:
            return pf
        # Unbuffered reads load a whole column chunk at once: fine for the usual row groups, not for a file
        # written as one huge group. Buffered reads keep 1 MiB per column, ~10% slower.
        return pq.ParquetFile(source, pre_buffer=False, read_dictionary=read_dictionary, buffer_size=1 << 20)
    except pa.ArrowException as exc:
        raise FormatError(f"{_source(path)}: not a readable Parquet file: {exc}") from None


def _largest_row_group(pf: pq.ParquetFile) -> int:
    """Compressed bytes of the file's largest row group (from the footer)."""
    meta = pf.metadata
    sizes = (meta.row_group(i).column(j).total_compressed_size
             for i in range(meta.num_row_groups) for j in range(meta.num_columns))
    return int(max(sizes, default=0)) * int(meta.num_columns)  # the largest chunk, as if all columns were as big


_STDIN: list[bytes] = []


def _stdin_bytes() -> bytes:
    # Standard input can be read once, and a file with string ids is opened twice (schema, then data).
    if not _STDIN:
        import sys

        _STDIN.append(sys.stdin.buffer.read())
    return _STDIN[0]


def _batches(
    pf: pq.ParquetFile,
    path: Source,
    columns: list[str] | None,
    row_bytes: int,
    prepare: Callable[[pa.RecordBatch], T],
    progress: Progress | None,
) -> Iterator[T]:
    """``prepare(batch)`` for each record batch, on a reading thread ahead of the caller; progress after each.

    ``prepare`` (the Arrow-to-NumPy adapter) runs on the reading thread too,
    beside the caller's reduction of the previous batch.
    """
    total = pf.metadata.num_rows
    batches = _record_batches(pf, columns, max(1, row_bytes))
    done = 0
    try:
        for n, prepared in read_ahead((b.num_rows, prepare(b)) for b in batches):
            yield prepared
            done += n
            if progress is not None:
                progress(done, total)
    except pa.ArrowException as exc:
        raise FormatError(f"{_source(path)}: cannot read Parquet data: {exc}") from None


def _record_batches(pf: pq.ParquetFile, columns: list[str] | None, row_bytes: int) -> Iterator[pa.RecordBatch]:
    """The file's rows in record batches: a row group at a time when it decodes to at most 8 x ``_BATCH_BYTES``.

    Whole row groups decode each column chunk in one call, measured ~25% faster
    than slicing them into batches; a bigger group (a file written as one huge
    row group) is sliced into batches of ~``_BATCH_BYTES``, so memory stays bounded.
    """
    meta = pf.metadata
    for i in range(meta.num_row_groups):
        rows = meta.row_group(i).num_rows
        if rows * row_bytes <= 8 * _BATCH_BYTES:
            yield from pf.read_row_group(i, columns=columns, use_threads=True).to_batches()
        else:
            size = max(1024, _BATCH_BYTES // row_bytes)
            yield from pf.iter_batches(batch_size=size, row_groups=[i], columns=columns, use_threads=True)


def _source(path: Source) -> str:
    return path if isinstance(path, str) and path != "-" else "<stdin>"


# --- writing -----------------------------------------------------------------------------


def write_owner_sum(path: str, shards: Any, totals: Any) -> None:
    """Write owner-sum results to ``path`` as Parquet (``shard_id``, ``total``), atomically.

    Args:
        path: the output file.
        shards: S shard ids (a NumPy array or ``array.array``, or a list of ints or strings).
        totals: S totals (a NumPy array or ``array.array``, or a list of numbers or of vectors of one length D).

    Raises:
        FormatError: what a Parquet column cannot hold exactly, named: totals
            of several shapes, an integer total beside floats beyond 2**53, an
            integer beyond int64, a string id that is not valid Unicode.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "out.parquet")
    >>> write_owner_sum(path, ["x", "y"], [2**53 + 1, 3])
    >>> pq.read_table(path).column("total").to_pylist()
    [9007199254740993, 3]
    """
    shards, totals = _numpy_if_typed(shards), _numpy_if_typed(totals)
    ids = _ids_array(shards)
    table = pa.Table.from_arrays([ids, _totals_array(shards, totals)], names=["shard_id", "total"])
    _write(path, table)


def write_mean(path: str, means: Any) -> None:
    """Write the P means to ``path`` as Parquet (``parameter``, ``mean``), atomically.

    Args:
        path: the output file.
        means: P floats (a NumPy array or a list).
    """
    values = np.asarray(means, dtype=np.float64)
    parameters = arrow.numbers_to_arrow(np.arange(len(values), dtype=np.int64))
    _write(path, pa.Table.from_arrays([parameters, arrow.numbers_to_arrow(values)], names=["parameter", "mean"]))


def _write(path: str, table: pa.Table) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _numpy_if_typed(x: Any) -> Any:
    """An ``array.array`` (the native backend's results) as a NumPy view, so no Python number is made per row.

    An empty one too: as a list, an empty ``array("d")`` of totals would be written as int64.
    """
    return np.frombuffer(x, dtype=x.typecode) if type(x).__module__ == "array" else x


def _ids_array(shards: Any) -> Any:
    values = list(shards.tolist()) if isinstance(shards, np.ndarray) and shards.dtype.kind == "O" else shards
    if isinstance(values, np.ndarray):
        if values.dtype.kind in "iu":
            return arrow.numbers_to_arrow(values.astype(np.int64, copy=False))
        values = values.tolist()
    kinds = set(map(type, values))  # (a set of types: C speed on 10^6 ids)
    if values and (kinds <= {str} or all(isinstance(v, str) for v in values)):
        return arrow.strings_to_arrow([str(v) for v in values] if kinds - {str} else values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return arrow.numbers_to_arrow(_int64(values, "shard id", values))
    raise FormatError(
        f"cannot write Parquet: shard ids must be all ints or all strings, got {sorted(k.__name__ for k in kinds)}"
    )


def _totals_array(shards: Any, totals: Any) -> Any:
    if isinstance(totals, np.ndarray) and totals.dtype.kind in "if":
        return arrow.numbers_to_arrow(totals.astype(np.float64 if totals.dtype.kind == "f" else np.int64))
    values = totals.tolist() if isinstance(totals, np.ndarray) else list(totals)
    shapes = {len(t) if isinstance(t, list) else None for t in values}
    if len(shapes) > 1:
        raise FormatError(
            f"cannot write Parquet: the totals have different shapes ({_shapes(shapes)}); "
            "one Parquet column holds one shape, so write JSON instead (-o FILE.json)"
        )
    flat = [x for t in values for x in (t if isinstance(t, list) else [t])]
    shape = (len(values), *((shapes.pop(),) if shapes and shapes != {None} else ()))
    names = list(shards.tolist() if isinstance(shards, np.ndarray) else shards)
    if all(isinstance(x, int) for x in flat):
        return arrow.numbers_to_arrow(_int64(flat, "total", names).reshape(shape))
    _check_exact_as_float(flat, names, shape)
    return arrow.numbers_to_arrow(np.array(flat, dtype=np.float64).reshape(shape))


def _int64(values: list[Any], what: str, names: list[Any]) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)
    except OverflowError:
        k = next(k for k, v in enumerate(values) if not -(2**63) <= v < 2**63)
        per = max(1, len(values) // max(1, len(names)))
        raise FormatError(
            f"cannot write Parquet: the {what} {short_repr(values[k])} (shard {short_repr(names[k // per])}) "
            "is beyond int64, which a "
            "Parquet int64 column cannot hold; write JSON instead (-o FILE.json)"
        ) from None


def _check_exact_as_float(flat: list[Any], names: list[Any], shape: tuple[int, ...]) -> None:
    """Integer totals beside float ones go into a float64 column only if float64 holds them exactly."""
    per = int(shape[1]) if len(shape) == 2 else 1
    for k, x in enumerate(flat):
        if isinstance(x, int) and abs(x) > _EXACT:
            raise FormatError(
                f"cannot write Parquet: shard {short_repr(names[k // max(1, per)])} has the exact integer total "
                f"{short_repr(x)}, "
                "other totals are floats, and one Parquet column has one type: float64 would round it; "
                "write JSON instead (-o FILE.json)"
            )


def _shapes(shapes: set[int | None]) -> str:
    return ", ".join("scalar" if s is None else f"vector of {s}" for s in sorted(shapes, key=lambda s: s or -1))
