"""Parquet input and output for both contracts, streamed in record batches.

A Parquet file is read one record batch at a time (~32 MiB decoded, on pyarrow's
threads, the next batch while this one is reduced) and each batch is fed to an
accumulator of :mod:`gradagg.engine`, so memory stays bounded however long the
file is: for owner-sum it grows with the number of distinct shards, for the
mean with one batch plus the P results. Columns reach the engines as NumPy
views of the Arrow buffers, without copies and without pandas (pyarrow's
``to_numpy()`` and ``pa.array()`` import pandas: ~0.3 s of start-up).

Owner-sum input schema (one row per gradient a worker reports for a shard)::

    column     type                                         meaning
    shard_id   int64 (or int32) | string                    the shard
    worker_id  int32 | int64 | string                       the worker (rank) that produced the row
    owner_id   int32 | int64 | string, the kind of          the shard's declared owner; the row
               worker_id (both integers or both strings)    counts only when worker_id == owner_id
    gradient   float64 (or float32)                         a scalar gradient, or
               | fixed_size_list<float32 | float64>[D]      a vector of D elements

``string`` may also be ``large_string`` or dictionary-encoded strings. Other
columns are ignored. No nulls: a null id, gradient or vector element is an
error naming its row (rows count from 0 in file order, as in the other
formats). Totals are summed in float64 (float32 gradients included).

Microbatch-mean input schema (the layout that streams: P can be 10^7, M is a
handful)::

    one column per microbatch, in microbatch order   float64 | float32, nullable
    one row per parameter                            a null cell = the parameter was absent

Column names are free. The divisor M is the number of columns, counted from the
schema before any row is read; a null contributes zero and is still counted in
M; NaN is a value, never absence. This is the transpose of the CSV and JSON
forms (one line per microbatch) on purpose: Parquet streams rows, and every
parameter row is independent, so a batch of parameters is done in one step.
There are no activity counters in Parquet: participation is the number of
non-null cells of a row, and it is never a divisor.

Output (``-o FILE.parquet``): owner-sum writes ``shard_id`` (int64 or large_string)
and ``total`` (float64, int64 for integer totals of JSON/CSV input, or
fixed_size_list<float64>[D]); the mean writes ``parameter`` (int64, from 0) and
``mean`` (float64). The file appears all at once (temporary file, then rename).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from queue import Full, Queue
from typing import Any, NamedTuple, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gradagg.engine import MicrobatchMeanAccumulator, OwnerSumAccumulator
from gradagg.errors import FormatError, GradientTypeError, IdError, NonFiniteGradientError
from gradagg.formats.atomic import atomic_path

T = TypeVar("T")
Progress = Callable[[int, int], None]
"""Called after each batch with (rows done, rows in the file)."""

OWNER_COLUMNS = ("shard_id", "worker_id", "owner_id", "gradient")
_NUMPY_TYPES: dict[pa.DataType, np.dtype[Any]] = {
    pa.int8(): np.dtype(np.int8), pa.int16(): np.dtype(np.int16), pa.int32(): np.dtype(np.int32),
    pa.int64(): np.dtype(np.int64), pa.float32(): np.dtype(np.float32), pa.float64(): np.dtype(np.float64),
}  # the types whose buffers NumPy can view: ids, dictionary indices, gradients, microbatch values
_WHOLE_CHUNKS_UP_TO = 256 << 20  # row groups up to this many compressed bytes are read a column chunk at once
_BATCH_BYTES = 8 << 20  # decoded bytes per batch: large enough to amortise per-batch Python, small to bound memory


class OwnerSchema(NamedTuple):
    """What :func:`check_owner_schema` learnt from a file's schema.

    A NamedTuple, not a dataclass: ``dataclasses`` imports ``inspect``, ~13 ms of every command's start-up.

    Attributes:
        shard_kind: ``"int"`` or ``"str"``.
        id_kind: ``"int"`` or ``"str"``: the kind of ``worker_id`` and ``owner_id``.
        dim: the vector length D of ``fixed_size_list`` gradients, ``None`` for scalars.
    """

    shard_kind: str
    id_kind: str
    dim: int | None


# --- owner-sum ---------------------------------------------------------------------------


def owner_sum_file(
    path: str, *, engine: str = "auto", nonfinite: str = "propagate", progress: Progress | None = None
) -> tuple[Any, Any]:
    """Owner-only shard reduction over a Parquet file, one record batch at a time.

    Args:
        path: the file (``-`` reads standard input, which is held in memory).
        engine: ``"auto"`` (numpy), ``"numpy"``, ``"torch"`` or ``"python"``
            (the reference; it keeps every owner row, so memory grows with the file).
        nonfinite: ``"propagate"`` or ``"raise"``.
        progress: called after each batch with (rows done, rows in the file).

    Returns:
        ``(shards, totals)``: sorted shard ids (an int64 array, or a list of
        str) and their totals, a float64 array of shape ``(S,)`` or ``(S, D)``.

    Raises:
        FormatError: not a Parquet file, a missing column or a column of the
            wrong type (naming the column, its type and the expected type).
        GradaggError: a null id or gradient, a non-finite gradient with
            ``nonfinite="raise"``: the message names the row.
    """
    pf = _open(path)
    schema = check_owner_schema(pf.schema_arrow, _source(path))
    strings = [name for name in OWNER_COLUMNS[:3] if _is_string(pf.schema_arrow.field(name).type)]
    if strings:  # reopened so that strings arrive as small dictionaries plus int32 indices
        pf = _open(path, read_dictionary=strings)
    reader = _OwnerBatches(schema, nonfinite)
    acc = OwnerSumAccumulator(engine=_streaming(engine), nonfinite="propagate")  # finiteness: checked by reader
    row_bytes = 24 + 8 * (schema.dim or 1)  # three 8-byte ids and the gradient, as decoded
    for columns in _batches(pf, path, list(OWNER_COLUMNS), row_bytes, reader.columns, progress):
        acc.update(*columns)
    shards, totals = acc.result()
    return reader.shards_back(shards, totals)


class _OwnerBatches:
    """Turns record batches into NumPy columns for the engine, checking nulls and finiteness on the way.

    Numeric columns are wrapped without a copy. String ids become int64 codes
    (first seen, first numbered; one table for shards, one shared by workers
    and owners so that equal strings get equal codes): the engine then runs
    its integer path, and :meth:`shards_back` turns codes into strings and
    sorts by them. Rows are numbered from the file's first row.
    """

    def __init__(self, schema: OwnerSchema, nonfinite: str) -> None:
        self.schema = schema
        self.nonfinite = nonfinite
        self.rows = 0
        self.shard_codes = _StringCodes() if schema.shard_kind == "str" else None
        self.id_codes = _StringCodes() if schema.id_kind == "str" else None
        self._zeros = np.zeros(0, dtype=np.int8)  # the worker and owner column handed on (all owner rows)

    def columns(self, batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        shards = self._ids(batch.column(0), "shard_id", self.shard_codes)
        workers = self._ids(batch.column(1), "worker_id", self.id_codes)
        owners = self._ids(batch.column(2), "owner_id", self.id_codes)
        grads = self._gradients(batch.column(3))
        owned = workers == owners
        if self.nonfinite == "raise":
            self._check_finite(shards, owned, grads)
        self.rows += batch.num_rows
        return self._owner_rows(owned, shards, grads)

    def _owner_rows(
        self, owned: np.ndarray, shards: np.ndarray, grads: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Only the owner rows, in row order, with worker = owner = 0: the engine then counts every row it gets.

        Replica rows are dropped here, before the engine, because they are most
        of a file (two in three in the benchmark): the engine then moves a third
        of the bytes, and ``np.compress`` copies a random selection several times
        faster than boolean indexing. Nothing else is lost: the ids and
        gradients were checked above, and each shard's rows keep their order.
        """
        shards, grads = np.compress(owned, shards, axis=0), np.compress(owned, grads, axis=0)
        if len(self._zeros) < len(shards):
            self._zeros = np.zeros(len(shards), dtype=np.int8)
        same = self._zeros[: len(shards)]
        return shards, same, same, grads

    def _ids(self, arr: pa.Array, name: str, codes: _StringCodes | None) -> np.ndarray:
        if arr.null_count:
            raise IdError(f"row {self.rows + _first_null(arr)}: {name} is null; every row needs a shard, worker "
                          "and owner id")
        return _numeric(arr) if codes is None else codes.encode(arr)

    def _gradients(self, arr: pa.Array) -> np.ndarray:
        if arr.null_count:
            raise GradientTypeError(f"row {self.rows + _first_null(arr)}: gradient is null; a row needs a number "
                                    "(absence has no meaning in owner-sum)")
        if self.schema.dim is None:
            return _numeric(arr)
        values = arr.flatten()  # the child values of these rows (flatten honours the slice offset)
        if values.null_count:
            r, k = divmod(_first_null(values), self.schema.dim)
            raise GradientTypeError(f"row {self.rows + r}: gradient element {k} is null")
        return _numeric(values).reshape(len(arr), self.schema.dim)

    def _check_finite(self, shards: np.ndarray, owned: np.ndarray, grads: np.ndarray) -> None:
        bad = ~np.isfinite(grads)
        rows = (bad.any(axis=1) if bad.ndim == 2 else bad) & owned  # replica rows are never counted, never checked
        if not rows.any():
            return
        r = int(rows.argmax())
        at, value = ("", grads[r]) if bad.ndim == 1 else (f" element {int(bad[r].argmax())}", grads[r, bad[r]][0])
        shard = self.shard_codes.strings[shards[r]] if self.shard_codes else int(shards[r])
        raise NonFiniteGradientError(
            f"row {self.rows + r}: gradient of shard {shard!r}{at} is {float(value)!r}; NaN and Inf are values, "
            "not absence"
        )

    def shards_back(self, shards: Any, totals: Any) -> tuple[Any, Any]:
        """Engine results as NumPy: string shards decoded and re-sorted (codes sort by first appearance)."""
        shards, totals = _to_numpy(shards), _to_numpy(totals)
        if self.shard_codes is None:
            return shards, totals
        strings = [self.shard_codes.strings[c] for c in shards.tolist()]
        order = sorted(range(len(strings)), key=strings.__getitem__)
        return [strings[i] for i in order], totals[np.asarray(order, dtype=np.int64)]


class _StringCodes:
    """int64 codes for string ids, numbered in order of first appearance; memory grows with distinct ids."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.strings: list[str] = []
        self._last: tuple[pa.Array, np.ndarray] | None = None  # a dictionary and its codes

    def encode(self, arr: pa.Array) -> np.ndarray:
        if not pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_encode()
        codes: np.ndarray = self._lookup(arr.dictionary)[_numeric(arr.indices)]
        return codes

    def _lookup(self, dictionary: pa.Array) -> np.ndarray:
        # Within a row group pyarrow hands every batch the dictionary so far, the last one's extended:
        # code only the new tail, or a file of 10^6 distinct ids would be coded several times over.
        last = self._last
        if last is not None and len(dictionary) >= len(last[0]) and dictionary.slice(0, len(last[0])).equals(last[0]):
            tail = dictionary.slice(len(last[0]))
            codes = np.concatenate([last[1], self._codes(tail.to_pylist())]) if len(tail) else last[1]
        else:
            codes = self._codes(dictionary.to_pylist())
        self._last = (dictionary, codes)
        return codes

    def _codes(self, strings: list[str]) -> np.ndarray:
        # Bulk dict operations run in C; a Python call per string would cost ~1 us each, seconds on 10^6 ids.
        # A dictionary's strings are distinct, so the unseen ones need no de-duplication.
        index = self.index
        new = [s for s in strings if s not in index]
        index.update(zip(new, range(len(self.strings), len(self.strings) + len(new))))
        self.strings.extend(new)
        return np.fromiter(map(index.__getitem__, strings), np.int64, len(strings))


def check_owner_schema(schema: pa.Schema, source: str = "input") -> OwnerSchema:
    """Check an owner-sum file's columns and types before any row is read.

    Args:
        schema: the file's Arrow schema.
        source: the file name, for messages.

    Returns:
        The id kinds and the vector length of the gradients.

    Raises:
        FormatError: a missing column, or a column of the wrong type; the
            message names the column, its type and the expected type.

    >>> check_owner_schema(pa.schema([("shard_id", pa.string()), ("worker_id", pa.int32()),
    ...                               ("owner_id", pa.int64()), ("gradient", pa.float64())]))
    OwnerSchema(shard_kind='str', id_kind='int', dim=None)
    >>> check_owner_schema(pa.schema([("shard_id", pa.float64()), ("worker_id", pa.int32()),
    ...                               ("owner_id", pa.int64()), ("gradient", pa.float64())]))
    Traceback (most recent call last):
    ...
    gradagg.errors.FormatError: input: column 'shard_id' has type double, expected int64, int32 or string
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


def _id_kind(source: str, name: str, t: pa.DataType) -> str:
    if pa.types.is_int64(t) or pa.types.is_int32(t):
        return "int"
    if _is_string(t):
        return "str"
    raise FormatError(f"{source}: column {name!r} has type {t}, expected int64, int32 or string")


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _gradient_dim(source: str, t: pa.DataType) -> int | None:
    if _is_float(t):
        return None
    if pa.types.is_fixed_size_list(t) and _is_float(t.value_type):
        return int(t.list_size)
    raise FormatError(
        f"{source}: column 'gradient' has type {t}, expected float64, float32 or "
        "fixed_size_list<float64 | float32>[D] (a variable-length list cannot promise one D per shard)"
    )


def _is_float(t: pa.DataType) -> bool:
    return bool(pa.types.is_float64(t) or pa.types.is_float32(t))


# --- microbatch mean -----------------------------------------------------------------------


def microbatch_mean_file(
    path: str, *, engine: str = "auto", nonfinite: str = "propagate", progress: Progress | None = None
) -> Any:
    """Microbatch mean over a Parquet file: one column per microbatch, one row per parameter.

    Each batch of parameter rows is complete in itself (it holds every
    microbatch of those parameters), so it is reduced on its own and the P
    means are concatenated; the divisor M is the column count, fixed before
    the first row is read.

    Args:
        path: the file (``-`` reads standard input, held in memory).
        engine: ``"auto"`` (numpy), ``"numpy"``, ``"torch"`` or ``"python"``.
        nonfinite: ``"propagate"`` or ``"raise"``.
        progress: called after each batch with (parameters done, parameters in the file).

    Returns:
        A float64 NumPy array of the P means (empty when M or P is 0, as the
        reference's result for no microbatches).

    Raises:
        FormatError: not a Parquet file, or a column that is not float64/float32.
        GradaggError: a non-finite value with ``nonfinite="raise"``, naming the
            microbatch (column) and the parameter (row).
    """
    pf = _open(path)
    m = check_mean_schema(pf.schema_arrow, _source(path))
    if m == 0:
        return np.zeros(0)  # no microbatch at all
    parts = [np.zeros(0)]
    done = 0
    for values, present in _batches(pf, path, None, 9 * m, _microbatches, progress):  # 8 + 1 bytes a cell
        if nonfinite == "raise":
            _check_finite_values(values, present, done, pf.schema_arrow.names)
        acc = MicrobatchMeanAccumulator(engine=_streaming(engine))  # one per batch: its parameters are complete
        acc.update(values, present)
        parts.append(_to_numpy(acc.result()))
        done += values.shape[1]
    return np.concatenate(parts)


def check_mean_schema(schema: pa.Schema, source: str = "input") -> int:
    """Check that every column is a float64/float32 microbatch; return M, the column count.

    Args:
        schema: the file's Arrow schema.
        source: the file name, for messages.

    Returns:
        M, the number of microbatches (the divisor).

    Raises:
        FormatError: a column of another type, named with its type.

    >>> check_mean_schema(pa.schema([("mb0", pa.float64()), ("mb1", pa.float32())]))
    2
    """
    for field in schema:
        if not _is_float(field.type):
            raise FormatError(
                f"{source}: column {field.name!r} has type {field.type}, expected float64 or float32 "
                "(the mean reads one column per microbatch, one row per parameter, null = absent)"
            )
    return len(schema)


def _microbatches(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """``(values, present)``, both ``(M, p)``, for the engine: row i is microbatch (column) i."""
    values = np.zeros((batch.num_columns, batch.num_rows), dtype=np.float64)
    present = np.ones(values.shape, dtype=bool)
    for i, column in enumerate(batch.columns):
        values[i] = _numeric(column)
        if column.null_count:
            present[i] = _valid(column)
            values[i, ~present[i]] = 0.0  # a null slot's buffer holds anything: keep it a harmless zero
    return values, present


def _valid(arr: pa.Array) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(arr.buffers()[0], dtype=np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


def _check_finite_values(values: np.ndarray, present: np.ndarray, first: int, names: list[str]) -> None:
    bad = ~np.isfinite(values) & present  # an absent cell is never checked: it holds no value
    if bad.any():
        i, j = divmod(int(bad.argmax()), values.shape[1])  # microbatch-major, as the reference scans
        raise NonFiniteGradientError(
            f"microbatch {i} (column {names[i]!r}), parameter {first + j} is {float(values[i, j])!r}; "
            "NaN and Inf are values, not absence"
        )


# --- reading -----------------------------------------------------------------------------


def _open(path: str, read_dictionary: list[str] | None = None) -> pq.ParquetFile:
    source: Any = path
    if path == "-":
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


def _numeric(arr: pa.Array) -> np.ndarray:
    """A NumPy view of a null-free numeric Arrow array's data buffer: no copy, and no pandas import.

    ``Array.to_numpy()`` would do the same but imports pandas (~0.3 s) the first time.
    """
    dtype = _NUMPY_TYPES[arr.type]
    view: np.ndarray = np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)
    return view


def _first_null(arr: pa.Array) -> int:
    """The index of the first null of ``arr`` (which has one), from its validity bitmap."""
    return int(np.argmin(_valid(arr)))


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, from the torch engine
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _batches(
    pf: pq.ParquetFile,
    path: str,
    columns: list[str] | None,
    row_bytes: int,
    prepare: Callable[[pa.RecordBatch], T],
    progress: Progress | None,
) -> Iterator[T]:
    """``prepare(batch)`` for record batches of about ``_BATCH_BYTES`` decoded bytes, reporting progress after each.

    ``prepare`` (checks, the owner-row selection) runs on the reading thread,
    beside the caller's reduction of the previous batch: on two cores the
    second core is then busy with more than decoding.
    """
    total = pf.metadata.num_rows
    rows = max(1024, _BATCH_BYTES // max(1, row_bytes))
    batches = pf.iter_batches(batch_size=rows, columns=columns, use_threads=True)
    done = 0
    try:
        for n, prepared in _read_ahead((b.num_rows, prepare(b)) for b in batches):
            yield prepared
            done += n
            if progress is not None:
                progress(done, total)
    except pa.ArrowException as exc:
        raise FormatError(f"{_source(path)}: cannot read Parquet data: {exc}") from None


def _read_ahead(batches: Iterator[T], depth: int = 2) -> Iterator[T]:
    """The same items, produced on a thread while the caller reduces the previous one.

    pyarrow decodes without holding the GIL and NumPy's loops mostly release
    it, so on two cores reading and reducing overlap. At most ``depth`` decoded
    batches wait in the queue, so memory stays bounded. An exception while
    reading is raised here, in the caller's thread.
    """
    queue: Queue[tuple[str, Any]] = Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in batches:
                if not _put(queue, stop, ("batch", batch)):
                    return  # the caller stopped early (an error in its reduction)
            _put(queue, stop, ("end", None))
        except BaseException as exc:  # handed to the caller, who re-raises it
            _put(queue, stop, ("error", exc))

    thread = threading.Thread(target=produce, name="gradagg-parquet-reader", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        thread.join()


def _put(queue: Queue[tuple[str, Any]], stop: threading.Event, item: tuple[str, Any]) -> bool:
    """Put ``item`` unless ``stop`` is set first; polls so that a stopped caller never leaves the thread blocked."""
    while not stop.is_set():
        try:
            queue.put(item, timeout=0.05)
            return True
        except Full:
            continue
    return False


def _streaming(engine: str) -> str:
    # For a file, "auto" means the streaming NumPy path: Parquet input is columnar already.
    return "numpy" if engine == "auto" else engine


def _source(path: str) -> str:
    return "<stdin>" if path == "-" else path


# --- writing -----------------------------------------------------------------------------


def write_owner_sum(path: str, shards: Any, totals: Any) -> None:
    """Write owner-sum results to ``path`` as Parquet, atomically.

    Args:
        path: the output file.
        shards: S shard ids (a NumPy array or a list of ints or strings).
        totals: S totals: numbers, or vectors of one length D.

    Raises:
        FormatError: totals of mixed shapes, or ids/totals Parquet cannot hold.
    """
    table = pa.Table.from_arrays([_id_array(shards), _totals_array(totals)], names=["shard_id", "total"])
    _write(path, table)


def write_mean(path: str, means: Any) -> None:
    """Write the P means to ``path`` as Parquet (``parameter``, ``mean``), atomically.

    Args:
        path: the output file.
        means: P floats (a NumPy array or a list).
    """
    values = np.asarray(means, dtype=np.float64)
    table = pa.Table.from_arrays(
        [_numeric_array(np.arange(len(values), dtype=np.int64)), _numeric_array(values)], names=["parameter", "mean"]
    )
    _write(path, table)


def _write(path: str, table: pa.Table) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _numeric_array(values: np.ndarray) -> pa.Array:
    # from_buffers wraps NumPy memory without pa.array(), which would import pandas.
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _id_array(ids: Any) -> pa.Array:
    values = ids if isinstance(ids, np.ndarray) else _list_to_numpy(list(ids), "shard id")
    if values.dtype.kind in "iu":
        return _numeric_array(values.astype(np.int64, copy=False))
    return _string_array([str(s) for s in values.tolist()])


def _string_array(strings: Sequence[str]) -> pa.Array:
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = pa.py_buffer(b"".join(encoded))
    return pa.Array.from_buffers(pa.large_string(), len(encoded), [None, pa.py_buffer(offsets), data])


def _totals_array(totals: Any) -> pa.Array:
    values = totals if isinstance(totals, np.ndarray) else _totals_to_numpy(list(totals))
    if values.ndim == 1:
        return _numeric_array(values)
    flat = _numeric_array(values.reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, int(values.shape[1]))


def _totals_to_numpy(totals: list[Any]) -> np.ndarray:
    shapes = {len(t) if isinstance(t, list) else None for t in totals}
    if len(shapes) > 1:
        raise FormatError(
            f"cannot write Parquet: the totals have different shapes ({_shapes(shapes)}); "
            "one Parquet column holds one shape, so write JSON instead (-o FILE.json)"
        )
    return _list_to_numpy(totals, "total")


def _shapes(shapes: set[int | None]) -> str:
    return ", ".join("scalar" if s is None else f"vector of {s}" for s in sorted(shapes, key=lambda s: s or -1))


def _list_to_numpy(values: list[Any], what: str) -> np.ndarray:
    """Python ids or totals as one NumPy array: int64 when all are ints, else float64 or strings."""
    flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
    if all(isinstance(x, str) for x in flat) and flat:
        return np.array(values, dtype=object)
    kind: Any = np.int64 if all(isinstance(x, int) for x in flat) else np.float64
    try:
        return np.array(values, dtype=kind)
    except (OverflowError, ValueError, TypeError):
        raise FormatError(f"cannot write Parquet: a {what} does not fit int64/float64; write JSON instead") from None
