"""Parquet in and out: record batches read as NumPy columns (via :mod:`gradagg.rows.formats.arrow`); results written.

Reading only: nothing here applies a contract (the engine drops replicas,
checks NaN and orders the shards; :func:`gradagg.rows.engine.owner_sum_batches`
takes what :func:`owner_batches` yields). A file is read a row group at a time
(or ~8 MiB decoded at a time of a big one) on a thread of its own, the next
one decoding while the caller reduces this one (the next two, on two threads,
for a file of many row groups), so memory stays bounded however long the file is.

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

A file is trusted no further than its footer agrees with itself: before any
row is read, every row group must list one column chunk per schema column and
the row groups must add up to the file's rows; before any row of a row group is
handed on, each chunk read must be the schema's column at that place (pyarrow
reads chunks by position: a reordered chunk would swap columns), by its path
and by where its data lies (the row groups one after another, each group's
chunks in the schema's order, as every writer lays them out: a chunk listed
in two row groups would be read for both), and a flat
column's chunk must hold as many values as the row group declares rows; and the
row group must decode to the rows it declares. Page checksums are verified
where the writer wrote them. pyarrow's own errors come back as a
:class:`~gradagg.errors.FormatError` naming the file.

Output (``-o FILE.parquet``): :func:`write_owner_sum` and :func:`write_mean`,
from :mod:`gradagg.rows.formats.parquet_write`.
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterator
from queue import Full, Queue
from typing import Any, BinaryIO, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from gradagg.errors import FormatError, GradaggError
from gradagg.rows.formats import arrow
from gradagg.rows.formats.parquet_write import write_mean, write_owner_sum

T = TypeVar("T")
Source = str | BinaryIO
"""A file's path, ``-`` for standard input, or a binary file object (standard input's bytes, say)."""
Progress = Callable[[int, int], None]
"""Called after each batch with (rows done, rows in the file)."""

OWNER_COLUMNS = arrow.OWNER_COLUMNS
_WHOLE_CHUNKS_UP_TO = 256 << 20  # row groups up to this many decoded bytes are read a column chunk at once
_BATCH_BYTES = 8 << 20  # decoded bytes per batch: large enough to amortise per-batch Python, small to bound memory
# Files of more row groups than this decode two at a time: for a few, the pool's start-up and the first group's
# single-threaded decode cost more than the overlap brings.
_PARALLEL_GROUPS = 16


def owner_batches(path: Source, *, progress: Progress | None = None) -> Iterator[tuple[Any, Any, Any, Any]]:
    """The rows of an owner-sum Parquet file as ``(shard_ids, worker_ids, owner_ids, gradients)`` NumPy batches.

    Args:
        path: the file, ``-`` for standard input (held in memory), or a binary file object.
        progress: called after each batch with (rows done, rows in the file).

    Yields:
        Four NumPy columns per record batch (see :class:`gradagg.rows.formats.arrow.OwnerBatches`).

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
    adapter = arrow.OwnerBatches(pf.schema_arrow, _source(path))  # the schema checked before any row is read
    if adapter.strings:  # reopened so that strings arrive as small dictionaries plus indices: decoded once per id
        pf = _open(path, read_dictionary=adapter.strings)
    yield from _batches(pf, path, list(OWNER_COLUMNS), adapter.row_bytes, adapter.columns, progress)


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
    elif path == "-" or not stat.S_ISREG(os.stat(path).st_mode):
        # Parquet's footer is at the end: standard input, a FIFO or a device (``<(cat f.parquet)``) is read
        # once, whole, by Python (interruptible), instead of pyarrow reopening it and blocking in open().
        source = pa.BufferReader(_read_once(path))
    try:
        # pre_buffer=False: with pre-buffering, pyarrow keeps every buffered column chunk until the file is
        # closed (a peak resident size several times the decoded batch). No memory map: mapped pages count
        # in the resident size and stay there as the file is read.
        pf = pq.ParquetFile(source, pre_buffer=False, read_dictionary=read_dictionary,
                            page_checksum_verification=True)
        check_footer(pf.metadata, _source(path))
        pf.schema_arrow  # noqa: B018  (built here, so that a corrupt schema is refused here, named)
        if _largest_row_group(pf) <= _WHOLE_CHUNKS_UP_TO:
            return pf
        # Unbuffered reads load a whole column chunk at once: fine for the usual row groups, not for a file
        # written as one huge group. Buffered reads keep 1 MiB per column.
        return pq.ParquetFile(source, pre_buffer=False, read_dictionary=read_dictionary, buffer_size=1 << 20,
                              page_checksum_verification=True)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # (a column name that is not UTF-8)
        if isinstance(exc, OSError) and exc.filename:
            raise  # the system's own error (no such file, permission), naming the file
        raise FormatError(f"{_source(path)}: not a readable Parquet file: {_one_line(exc)}") from None


def check_footer(meta: pq.FileMetaData, source: str = "input") -> None:
    """Refuse a footer whose row groups disagree with the schema or the file's row count, before any row is read.

    Only the row groups' own fields are read here: pyarrow 26 aborts the process (``std::terminate``) when
    Python asks for a column chunk whose metadata is corrupt, where its reader raises an error instead; so
    each chunk is checked by :func:`check_row_group`, after pyarrow has decoded that row group.

    Args:
        meta: the file's metadata.
        source: the file name, for messages.

    Raises:
        FormatError: a row group with more or fewer column chunks than the schema has columns, or row
            groups whose rows do not add up to the file's.
    """
    columns = meta.num_columns
    rows = 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        if group.num_columns != columns:
            paths = ", ".join(meta.schema.column(j).path for j in range(columns))
            raise FormatError(
                f"{source}: row group {i} has {group.num_columns} column chunks but the schema has {columns} "
                f"columns ({paths}); the file is corrupt"
            )
        rows += group.num_rows
    if rows != meta.num_rows:
        raise FormatError(f"{source}: the row groups hold {rows} rows but the footer declares {meta.num_rows}")


Placed = tuple[int, str, int, int]
"""Where a chunk read lies: its row group, its column's path, and its data's byte range (start, end)."""


def check_row_group(
    meta: pq.FileMetaData, i: int, names: list[str] | None, source: str = "input", after: Placed | None = None
) -> Placed | None:
    """Refuse row group ``i`` where a chunk of the columns read is not what the schema says is there.

    Args:
        meta: the file's metadata.
        i: the row group, already decoded by pyarrow (so its chunks' metadata is sound).
        names: the top-level columns read (None: all).
        source: the file name, for messages.
        after: where the last chunk read of the previous row groups lies (what this function returned for them).

    Returns:
        Where the last chunk read of this row group lies (``after`` when it has none with data), for the next.

    Raises:
        FormatError: a chunk listed at another column's place (pyarrow reads chunks by position: the
            columns would be swapped), whether its path says so or its data's place in the file (data out of
            the schema's order, data before the previous row group's, or two chunks on the same bytes: one
            chunk listed twice, in one row group or two), or a flat column's chunk holding another number of
            values than the row group declares rows.
    """
    group, schema = meta.row_group(i), meta.schema
    before = after  # the previous chunk read, in this row group or an earlier one
    for j in range(meta.num_columns):
        column = schema.column(j)
        if names is not None and column.path.split(".")[0] not in names:
            continue
        chunk = group.column(j)
        if group.num_rows:  # (an empty group's chunks have no data page: pyarrow writes offset 0 for each)
            before = _check_data_order(chunk, (i, column.path), before, f"{source}: row group {i}")
        if chunk.path_in_schema != column.path:
            raise FormatError(
                f"{source}: row group {i} lists the chunk of column {chunk.path_in_schema!r} where the schema "
                f"has column {column.path!r} (column {j}); read by position, the columns would be swapped"
            )
        if column.max_repetition_level == 0 and chunk.num_values != group.num_rows:
            raise FormatError(
                f"{source}: row group {i} declares {group.num_rows} rows but its column {column.path!r} holds "
                f"{chunk.num_values} values; the file is corrupt"
            )
    return before


def _check_data_order(chunk: Any, column: tuple[int, str], before: Placed | None, where: str) -> Placed:
    """Refuse a chunk whose data starts before the end of the previous chunk read: return where it lies.

    A chunk's path can be rewritten to the schema's at its place while its offsets still point at another
    column's data (pyarrow then reads shard ids as gradients), and a row group can list another group's chunk,
    its path right (pyarrow then reads that chunk for both groups' rows); every writer lays the row groups out
    one after another, each group's chunks in the schema's order, so data out of that order, or two chunks on
    one place, is refused.
    """
    start = chunk.data_page_offset  # where pyarrow starts reading the chunk (its ComputeColumnChunkRange)
    dictionary = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
    if dictionary is not None and 0 < dictionary < start:
        start = dictionary
    end = start + chunk.total_compressed_size
    group, path = column
    if before is not None and start < before[3]:
        place = "before" if start < before[2] else "within"
        if before[0] == group:
            of, why = "", "the chunks are listed in another order than their data, and read by position the columns"
            why += " would be swapped"
        else:
            of, why = f" of row group {before[0]}", "a chunk listed in two row groups, or row groups listed in another"
            why += " order than their data, would pair rows that are not rows of the file"
        raise FormatError(
            f"{where}: the data of column {path!r} lies {place} the data of column {before[1]!r}{of} (bytes "
            f"{start}..{end} and {before[2]}..{before[3]}); {why}"
        )
    return group, path, start, end


def _largest_row_group(pf: pq.ParquetFile) -> int:
    """Decoded bytes of the file's largest row group, as its footer entry says (no chunk's metadata is read)."""
    meta = pf.metadata
    return max((int(meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)), default=0)


_READ: dict[str, bytes] = {}


def _read_once(path: str) -> bytes:
    """The bytes of standard input (``-``) or of a file that cannot be read twice, read once and kept.

    A file with string ids is opened twice (schema, then data), and a pipe can be read once only.
    """
    if path not in _READ:
        if path == "-":
            import sys

            _READ[path] = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                _READ[path] = f.read()
    return _READ[path]


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
    source = _source(path)
    done = 0
    try:
        batches = _record_batches(pf, columns, row_bytes, source)
        for n, prepared in _read_ahead((b.num_rows, prepare(b)) for b in batches):
            yield prepared
            done += n
            if progress is not None:
                progress(done, total)
    except GradaggError:
        raise
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # pyarrow's text names no file
        raise FormatError(f"{source}: cannot read Parquet data: {_one_line(exc)}") from None


def _record_batches(
    pf: pq.ParquetFile, columns: list[str] | None, row_bytes: int, source: str
) -> Iterator[pa.RecordBatch]:
    """The file's rows in record batches: a row group at a time when it decodes to at most 8 x ``_BATCH_BYTES``.

    Whole row groups decode each column chunk in one call, faster than slicing
    them into batches; a bigger group (a file written as one huge row group) is
    sliced into batches of ~``_BATCH_BYTES``, so memory stays bounded. No batch
    of a row group is handed on before its chunks are checked
    (:func:`check_row_group`), and each row group must decode to the rows it declares.
    """
    meta = pf.metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    whole = [rows * max(1, row_bytes) <= 8 * _BATCH_BYTES for rows in sizes]
    tables = _decoded_ahead(pf, columns, [i for i, w in enumerate(whole) if w])
    placed: Placed | None = None  # where the last chunk read lies: each row group's must lie after it
    for i, rows in enumerate(sizes):
        if whole[i]:
            batches: Iterator[pa.RecordBatch] = iter(next(tables).to_batches())
        else:
            size = max(1024, _BATCH_BYTES // max(1, row_bytes))
            batches = pf.iter_batches(batch_size=size, row_groups=[i], columns=columns, use_threads=True)
        first = next(batches, None)  # decoded: pyarrow has read (and vetted) the chunks' metadata
        placed = check_row_group(meta, i, columns, source, placed)
        decoded = 0
        for batch in itertools.chain([] if first is None else [first], batches):
            decoded += batch.num_rows
            yield batch
        if decoded != rows:
            raise FormatError(f"{source}: row group {i} declares {rows} rows but {decoded} were decoded")


def _decoded_ahead(pf: pq.ParquetFile, columns: list[str] | None, groups: list[int]) -> Iterator[pa.Table]:
    """Row groups ``groups`` decoded whole, in order; two at a time on two threads for a file of many groups.

    Two row groups at once keep two cores busy where one group's few columns,
    decoded in parallel, leave one waiting on the largest; one reader serves
    both threads, as pyarrow's own dataset scanner reads row groups of a file
    concurrently. At most two decoded groups wait, so memory stays bounded.
    """
    if len(groups) <= _PARALLEL_GROUPS:
        yield from (pf.read_row_group(i, columns=columns, use_threads=True) for i in groups)
        return
    from concurrent.futures import Future, ThreadPoolExecutor

    def read(i: int) -> pa.Table:
        return pf.read_row_group(i, columns=columns, use_threads=True)

    pool = ThreadPoolExecutor(2, thread_name_prefix="gradagg-decode")
    pending = iter(groups)
    ahead: deque[Future[pa.Table]] = deque(pool.submit(read, i) for i in itertools.islice(pending, 2))
    try:
        while ahead:
            table = ahead.popleft().result()
            ahead.extend(pool.submit(read, i) for i in itertools.islice(pending, 1))
            yield table
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _read_ahead(items: Iterator[T]) -> Iterator[T]:
    """The same items, produced on a thread while the caller handles the previous one.

    pyarrow's decoding and NumPy's sums release the GIL, so on two cores
    reading and reducing overlap. One item waits at most, so memory stays
    bounded (one waiting, one being produced, one being consumed). An exception
    while producing is raised here, in the caller's thread; a caller that stops
    early stops the thread too.
    """
    queue: Queue[tuple[str, Any]] = Queue(maxsize=1)
    stop = threading.Event()

    def put(item: tuple[str, Any]) -> bool:
        while not stop.is_set():  # polls, so that a stopped caller never leaves the thread blocked
            try:
                queue.put(item, timeout=0.05)
                return True
            except Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(("item", item)):
                    return
            put(("end", None))
        except BaseException as exc:  # handed to the caller, who re-raises it
            put(("error", exc))

    thread = threading.Thread(target=produce, name="gradagg-read-ahead", daemon=True)
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


def _one_line(exc: BaseException) -> str:
    """pyarrow's message on one line (some carry the C++ source location on lines of their own)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _source(path: Source) -> str:
    return path if isinstance(path, str) and path != "-" else "<stdin>"


__all__ = ["check_footer", "check_row_group", "microbatch_batches", "owner_batches", "write_mean", "write_owner_sum"]
