"""The native backend: owner-sum on buffer columns (the native Parquet reader's), reduced in C, without NumPy.

The table is ``gradagg._native._ownersum.Table`` (see ``ownersum.c``): each
shard's owner gradients are added one at a time in row order into a total that
starts at ``-0.0``, exactly as :mod:`gradagg.backends.numpy` does, so float
totals are bit-identical to :func:`gradagg.reference.owner_sum`. Integer totals
are exact: a running total that would leave int64 is an error naming the row
and pointing to ``engine="python"`` (never a wrapped answer). Float32 gradients
are summed in float64.

Columns are buffers of integers or floats: a typed ``memoryview`` (formats
``i``, ``q`` for ids; ``i``, ``q``, ``f``, ``d`` for gradients), an
``array.array``, or a dictionary-encoded column, an object with ``values``
(the distinct ids, a memoryview) and ``indices`` (uint32 per row, a
memoryview, or None). Results are ``array.array`` objects: ``"q"`` shards,
``"d"`` or ``"q"`` totals. Only integer ids and scalar gradients come here (the
engine routes everything else to the other backends).
"""

from __future__ import annotations

from array import array
from typing import Any

from gradagg._native import load
from gradagg.errors import GradaggError, GradientTypeError, IdError, NonFiniteGradientError, RowShapeError, short_repr
from gradagg.options import check_nonfinite

_ID_FORMATS, _INT_FORMATS, _FLOAT_FORMATS = "iq", "iq", "fd"


def available() -> bool:
    """Whether the compiled table is built (and not switched off with ``GRADAGG_NATIVE=0``).

    >>> isinstance(available(), bool)
    True
    """
    return load("_ownersum") is not None


class OwnerSumAccumulator:
    """Owner-sum fed batches of buffer columns; memory grows with the distinct shards (or their range), not rows.

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.

    Raises:
        GradaggError: when the compiled table is not built.

    Used through the engine, which routes buffers here when the table is built (else to NumPy, same answer):

    >>> from gradagg import engine
    >>> acc = engine.OwnerSumAccumulator()
    >>> acc.update(array("q", [3, 3, 1]), array("i", [0, 1, 2]), array("i", [0, 0, 2]), array("d", [1.0, 9.0, 2.0]))
    >>> [x.tolist() for x in acc.result()], acc.engine == ("native" if available() else "numpy")
    ([[1, 3], [2.0, 1.0]], True)
    """

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        self._nonfinite = check_nonfinite(nonfinite)
        self._module: Any = load("_ownersum")
        if self._module is None:
            raise GradaggError("the native backend is not built (or GRADAGG_NATIVE=0); use engine='numpy'")
        self._table: Any = None
        self._ints: bool | None = None
        self._rows = 0
        self._failed: str | None = None  # an update stopped part-way: the totals are not those of whole batches

    def update(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> None:
        """Add a batch of rows (four buffer columns of equal length).

        Args:
            shard_ids: N integer ids.
            worker_ids: N integer worker ids.
            owner_ids: N integer owner ids.
            gradients: N integers or floats.

        Raises:
            GradaggError: columns of other types or lengths; a batch whose gradients
                change kind (ints, floats); a counted NaN/Inf with ``"raise"``; an
                integer total beyond int64.
        """
        specs = [_spec(name, c, _ID_FORMATS) for name, c in zip(("shard_ids", "worker_ids", "owner_ids"),
                                                                 (shard_ids, worker_ids, owner_ids))]
        grads = _spec("gradients", gradients, _INT_FORMATS + _FLOAT_FORMATS)
        if grads[1] is not None:
            raise GradientTypeError("gradients: a dictionary-encoded gradient column; pass its values")
        _check_lengths([*specs, grads])
        ints = grads[0].format in _INT_FORMATS
        if self._table is None:
            self._ints = ints
            self._table = self._module.Table(ints, self._nonfinite == "raise")
        elif ints != self._ints:
            raise GradientTypeError(
                f"row {self._rows}: gradients are {'integers' if ints else 'floats'} here but "
                f"{'integer' if self._ints else 'float'} totals before; feed one numeric kind (integers or floats)"
            )
        self._check_usable()
        try:
            status, row, before = self._table.update(*specs, grads)
        except ValueError as exc:  # the table's own check of what Python cannot see cheaply: dictionary indices
            self._failed = str(exc)
            raise IdError(f"rows from {self._rows}: {exc}") from None
        if status:
            error = self._stopped(status, row, before, specs[0], grads[0])
            self._failed = str(error)
            raise error
        self._rows += _length(grads)

    def result(self) -> tuple[array[int], array[Any]]:
        """Return ``(shards, totals)`` over every row fed so far, shards ascending.

        Returns:
            ``array("q")`` shards with an owner row and their ``array("d")`` (or ``array("q")``) totals.
        """
        self._check_usable()
        if self._table is None:
            return array("q"), array("d")
        keys, totals = self._table.result()
        shards, sums = array("q"), array("q" if self._ints else "d")
        shards.frombytes(keys)
        sums.frombytes(totals)
        return shards, sums

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise GradaggError(f"this accumulator stopped part-way through a batch ({self._failed}); start a new one")

    def _stopped(self, status: int, row: int, before: int, shards: tuple[Any, Any], grads: Any) -> GradaggError:
        values, indices = shards
        shard = values[row if indices is None else indices[row]]
        at = f"row {self._rows + row}: gradient of shard {short_repr(shard)}"
        if status == 1:  # the reference's words, as the NumPy backend's
            return NonFiniteGradientError(f"{at} is {float(grads[row])!r}; NaN and Inf are values, not absence")
        return GradaggError(f"{at}: its integer total {before} + {grads[row]} passes int64; use engine='python' "
                            "(the reference), which sums Python integers exactly")


def _spec(name: str, column: Any, formats: str) -> tuple[memoryview, memoryview | None]:
    """``(values, indices)`` memoryviews of a column, checked to be of one of ``formats`` (indices uint32)."""
    indices = getattr(column, "indices", None)
    values = _view(getattr(column, "values", column))
    if values.format not in formats or values.ndim != 1:
        raise (IdError if name != "gradients" else GradientTypeError)(
            f"{name}: a buffer of format {values.format!r} and {values.ndim} dimensions; the native backend takes "
            f"one dimension of format {' or '.join(formats)}"
        )
    if indices is not None:
        indices = _view(indices)
        if indices.format != "I" or indices.ndim != 1:
            raise IdError(f"{name}: dictionary indices must be uint32 (format 'I'), got {indices.format!r}")
    return values, indices


def _view(x: Any) -> memoryview:
    return x if isinstance(x, memoryview) else memoryview(x)


def _length(spec: tuple[memoryview, memoryview | None]) -> int:
    values, indices = spec
    return len(values if indices is None else indices)


def _check_lengths(specs: list[tuple[memoryview, memoryview | None]]) -> None:
    lengths = [_length(s) for s in specs]
    if len(set(lengths)) > 1:
        names = ("shard_ids", "worker_ids", "owner_ids", "gradients")
        listed = ", ".join(f"{name} has {n}" for name, n in zip(names, lengths))
        raise RowShapeError(f"columns differ in length: {listed} rows")


__all__ = ["OwnerSumAccumulator", "available"]
