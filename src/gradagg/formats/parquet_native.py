"""Owner-sum Parquet files decoded in C, without pyarrow or NumPy, where the file allows (the common case).

Reading only, like :mod:`gradagg.formats.parquet`: nothing here applies a
contract. :func:`owner_batches` decides per file, from its footer and before
any row is produced, whether the compiled decoder (``gradagg._native._pqdecode``)
takes it (:func:`gradagg.formats._parquet_meta.plan_columns` says what it
takes: flat INT32/INT64 ids, INT32/INT64/FLOAT/DOUBLE gradients, PLAIN or
dictionary pages v1/v2, UNCOMPRESSED or SNAPPY, no null). If it does not, or
the decoder is not built, it returns None and the caller reads the file with
:func:`gradagg.formats.parquet.owner_batches` instead, so one file never mixes
the two paths.

Batches of four :class:`Column` objects, at most :data:`BATCH_ROWS` rows each
(a row group is several), are decoded on a thread of their own while the caller
reduces the previous one (the decoder releases the GIL); each column chunk is
memory-mapped while its row group is read, and batch buffers are reused once
dropped, so little fresh memory is touched. Id columns stay dictionary-encoded
while every page of their chunk is and the dictionary is small next to a batch:
``values`` is then the chunk's dictionary and ``indices`` the uint32 index of
each row, so the engine maps each distinct id once per batch.

What the footer promised and the pages break (a corrupt page, a null in a
column whose statistics count none, a dictionary index past the dictionary)
is a :class:`~gradagg.errors.FormatError` naming the file, the row group and
the column; the decoder checks every length against the bytes it was given.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from gradagg._native import load
from gradagg.errors import FormatError, GradientTypeError, IdError
from gradagg.formats import _parquet_meta as meta
from gradagg.formats._readahead import read_ahead

OWNER_COLUMNS = ("shard_id", "worker_id", "owner_id", "gradient")
_IDS = {meta.INT32, meta.INT64}
_GRADIENTS = {meta.INT32, meta.INT64, meta.FLOAT, meta.DOUBLE}
_EMPTY: dict[int, memoryview[Any]] = {
    meta.INT32: memoryview(b"").cast("i"), meta.INT64: memoryview(b"").cast("q"),
    meta.FLOAT: memoryview(b"").cast("f"), meta.DOUBLE: memoryview(b"").cast("d"),
}
BATCH_ROWS = 1 << 17  # rows a batch: ~2.5 MiB decoded, in cache for the kernel; few enough Python steps
Batch = tuple["Column", "Column", "Column", "Column"]  # shard_ids, worker_ids, owner_ids, gradients


class Column:
    """A decoded column: ``values`` a typed memoryview; ``indices`` None, or uint32 row indices into ``values``.

    >>> c = Column(memoryview(b"\\x07\\x00\\x00\\x00\\x09\\x00\\x00\\x00").cast("i"), memoryview(bytes(4)).cast("I"))
    >>> len(c), c.item(0), c.tolist()
    (1, 7, [7])
    """

    __slots__ = ("indices", "values")

    def __init__(self, values: memoryview[Any], indices: memoryview[Any] | None = None) -> None:
        self.values, self.indices = values, indices

    def __len__(self) -> int:
        return len(self.values if self.indices is None else self.indices)

    def item(self, row: int) -> Any:
        """The value of row ``row``."""
        return self.values[row if self.indices is None else self.indices[row]]

    def tolist(self) -> list[Any]:
        """The values row by row, as Python numbers."""
        values = self.values.tolist()
        return values if self.indices is None else [values[i] for i in self.indices.tolist()]


def owner_batches(
    path: str | os.PathLike[str] | BinaryIO, *, progress: Callable[[int, int], None] | None = None
) -> Iterator[Batch] | None:
    """The rows of an owner-sum Parquet file as batches of four :class:`Column`, or None if this reader cannot.

    Args:
        path: the file (a path), or a binary file object (read whole: standard input's bytes, say).
        progress: called after each batch with (rows done, rows in the file).

    Returns:
        An iterator of ``(shard_ids, worker_ids, owner_ids, gradients)``, at most
        :data:`BATCH_ROWS` rows each, in file order (one batch of empty columns
        for a file without rows); or
        None when the decoder is not built, the file cannot be opened as a
        regular file, or its footer asks for something this reader does not
        decode (then :func:`gradagg.formats.parquet.owner_batches` reads it).

    Raises:
        FormatError: while iterating: a page that does not decode, named by row group and column.
        GradaggError: while iterating: a null value, naming its row.

    >>> owner_batches("/nonexistent.parquet") is None
    True
    """
    decoder = load("_pqdecode")
    source = _Source.open(path) if decoder is not None else None
    if source is None:
        return None
    try:
        footer = meta.read_footer(source.read_at, source.size)
        plan = meta.plan_columns(footer, OWNER_COLUMNS, [_IDS] * 3 + [_GRADIENTS])
    except (meta.Unsupported, OSError, FormatError):
        source.close()
        return None
    return _batches(_Decoding(decoder, source, plan), progress)


def _batches(decoding: _Decoding, progress: Callable[[int, int], None] | None) -> Iterator[Batch]:
    """The batches in order, decoded on a thread of their own while the caller reduces the previous one."""
    total, done = decoding.plan.rows, 0
    batches = read_ahead(decoding.batches())
    try:
        for rows, (shards, workers, owners, grads) in batches:
            yield shards, workers, owners, grads
            done += rows
            if progress is not None:
                progress(done, total)
    finally:
        batches.close()
        decoding.source.close()


class _Decoding:
    """Decodes a planned file's columns, a batch of at most :data:`BATCH_ROWS` rows at a time."""

    def __init__(self, decoder: Any, source: _Source, plan: meta.Plan) -> None:
        self.decoder, self.source, self.plan = decoder, source, plan

    def batches(self, slots: tuple[int, ...] = (0, 1, 2, 3)) -> Iterator[tuple[int, list[Column]]]:
        """``(rows, columns)`` of the columns at ``slots``, batch after batch."""
        first = 0
        for k, (rows, chunks) in enumerate(self.plan.row_groups):
            if not rows:
                continue
            decoders = [(slot, self._decoder(k, slot, rows, chunks[slot])) for slot in slots]
            for start in range(0, rows, BATCH_ROWS):
                m = min(BATCH_ROWS, rows - start)
                yield m, [self._read(k, first, slot, d, m) for slot, d in decoders]
            del decoders  # (and with them the row group's maps)
            first += rows
        if not first:  # no row at all: one empty batch, so that the engine still sees the columns' types
            yield 0, [Column(_EMPTY[self.plan.types[slot]]) for slot in slots]

    def _decoder(self, k: int, slot: int, rows: int, chunk: meta.Chunk) -> Any:
        data = self.source.view(chunk.start, chunk.length)
        # Ids may stay indices into their chunk's dictionary while it is small next to a batch (the engine then
        # maps each distinct id once per batch); gradients always come as values.
        small = BATCH_ROWS // 8 if slot < 3 else 0
        return self.decoder.Decoder(data, chunk.physical_type, chunk.codec, rows, chunk.max_definition_level, small)

    def _read(self, k: int, first: int, slot: int, decoder: Any, m: int) -> Column:
        name = OWNER_COLUMNS[slot]
        try:
            values, indices = decoder.read(m)
        except self.decoder.NullValue as exc:
            raise _null_error(name, first + int(exc.args[0])) from None
        except self.decoder.Malformed as exc:
            raise FormatError(f"{self.source.name}: cannot read Parquet data: row group {k}, column {name!r}: "
                              f"{exc}") from None
        return Column(memoryview(values), None if indices is None else memoryview(indices))


def _null_error(name: str, row: int) -> Exception:
    says = "although the file's statistics count no null in it"
    if name == "gradient":
        return GradientTypeError(f"row {row}: gradient is null ({says}); a row needs a number")
    return IdError(f"row {row}: {name} is null ({says}); every row needs a shard, worker and owner id")


class _Source:
    """Random reads from a regular file or from a file object's bytes in memory.

    A column chunk is memory-mapped (populated at once where the system allows):
    measured ~4x faster here than copying it out with ``pread``, and mapped pages
    leave the resident set when the chunk's decoder and its map are dropped, so
    memory stays bounded by one row group. (A file truncated by another process
    *while* it is mapped would stop this one with SIGBUS; a file that is already
    short is an error from its size, before any map.)
    """

    def __init__(self, name: str, size: int, fd: int | None, data: bytes | None) -> None:
        self.name, self.size, self._fd, self._data = name, size, fd, data

    @classmethod
    def open(cls, path: str | os.PathLike[str] | BinaryIO) -> _Source | None:
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str):
            path.seek(0)  # read whole; pyarrow's path seeks back to 0 if it gets the file instead
            data = path.read()
            return cls("<stdin>", len(data), None, data)
        if path == "-":
            return None  # standard input is read (once) by the pyarrow path's own cache
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None  # the pyarrow path names the problem as its users already see it
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            return None
        return cls(path, info.st_size, fd, None)

    def read_at(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (the footer), copied."""
        if self._data is not None:
            data = self._data[offset : offset + length]
        else:
            assert self._fd is not None  # one of the two is set
            data = os.pread(self._fd, length, offset)
        if len(data) != length:
            raise FormatError(f"{self.name}: the file is cut short: {length} bytes at {offset}, {len(data)} there")
        return data

    def view(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` (a column chunk, inside the file's size: the footer plan checked)."""
        if self._data is not None or length == 0:
            return memoryview(self._data or b"")[offset : offset + length]
        fd, start = self._fd, offset - offset % mmap.ALLOCATIONGRANULARITY
        assert fd is not None  # a file, not bytes
        if hasattr(mmap, "MAP_POPULATE"):
            mapped = mmap.mmap(fd, length + offset - start, offset=start, prot=mmap.PROT_READ,
                               flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        else:
            mapped = mmap.mmap(fd, length + offset - start, offset=start, access=mmap.ACCESS_READ)
        return memoryview(mapped)[offset - start :]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
