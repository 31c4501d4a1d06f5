"""Parquet out: results written with pyarrow, atomically (re-exported by :mod:`gradagg.rows.formats.parquet`).

Owner-sum writes ``shard_id`` (int64 or large_string) and ``total`` (float64,
int64 for exact integer totals, or fixed_size_list of them); the mean writes
``parameter`` (int64, from 0) and ``mean`` (float64). Nothing is ever rounded or
re-encoded on the way: what a Parquet column cannot hold exactly (an integer
total beside float totals that float64 would round, an integer beyond int64, a
lone surrogate in a string id) is an error naming it. The file appears all at
once (temporary file, rename).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gradagg.errors import FormatError, OutputError, short_repr
from gradagg.rows.formats import arrow
from gradagg.rows.formats.atomic import atomic_path

_EXACT = 2**53  # integers up to this magnitude are exact in float64


def write_owner_sum(path: str, shards: Any, totals: Any) -> None:
    """Write owner-sum results to ``path`` as Parquet (``shard_id``, ``total``), atomically.

    Args:
        path: the output file.
        shards: S shard ids (a NumPy array, or a list of ints or strings).
        totals: S totals (a NumPy array, or a list of numbers or of vectors of one length D).

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
        # An open file, not the path: pyarrow deletes a path it failed to write (a link to a device included).
        try:
            with open(tmp, "wb") as sink:
                pq.write_table(table, sink)
        except (pa.ArrowException, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise OutputError(f"{path}: cannot write the result: {reason}") from None  # pyarrow's text names no file


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
