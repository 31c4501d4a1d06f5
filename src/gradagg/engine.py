"""Columnar entry points for both contracts; the one place that chooses a backend.

The contracts are those of :mod:`gradagg.reference` (read its vocabulary
first); this module runs them on columns instead of rows:

* :func:`owner_sum_columns` — owner-only shard reduction over four columns
  (or one Arrow table).
* :func:`microbatch_mean_columns` — the microbatch mean over an ``(M, P)``
  array with an explicit ``present`` mask; the divisor is always M.
* :class:`OwnerSumAccumulator` / :class:`MicrobatchMeanAccumulator` — the
  same contracts fed batch by batch (e.g. Parquet record batches), in memory
  that grows with the number of distinct shards (resp. parameters), not rows.

Engines (``engine=``):

``"python"``
    The pure-Python reference itself, on the columns turned into rows. Slow,
    obviously right; useful to cross-check.
``"numpy"``
    :mod:`gradagg.backends.numpy`: vectorised NumPy, with fused one-pass
    kernels compiled by numba when numba is installed (same answers). Large
    inputs use a second core where that leaves every sum's order unchanged.
``"torch"``
    :mod:`gradagg.backends.torch`: PyTorch tensors on any device. CPU tensors
    go through the NumPy kernels on zero-copy views when numba is installed.
``"auto"`` (default)
    ``"torch"`` for torch tensors, ``"numpy"`` for NumPy arrays, Arrow tables
    and Python lists (the benchmark in ``bench/bench_engines.py`` shows the
    numpy backend fastest on CPU data), ``"python"`` when NumPy is missing.

Results come back in the input's array kind: NumPy in, NumPy out; torch in,
torch out on the same device (totals follow the gradients, shards follow the
shard ids, since torch cannot hold strings); Arrow or lists in, NumPy out.
Totals are ``int64`` for integer gradients and ``float64`` for floating ones
(float32 input is summed in float64, exactly as the reference sums Python
floats).

Numbers. The ``"numpy"`` engine, and ``"torch"`` on CPU, add each shard's
owner gradients one by one **in row order**, starting from the first row, so a
float total is bit-identical to :func:`gradagg.reference.owner_sum` on the same
rows (the tests check this on seeded random data). On CUDA the rows of a shard
are added in an unspecified order (atomic adds); each total then differs from
the reference by at most ``2 * (n - 1) * 2**-53 * sum(|g|)`` over that shard's
n owner rows (the worst-case bound of any summation order, applied to both).
Integer totals are exact while they fit in int64; a batch that could overflow
raises :class:`~gradagg.errors.GradaggError` (use ``engine="python"`` for
unbounded integers).

``import gradagg`` does not import this module; importing it imports neither
NumPy nor torch: each is loaded when first needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, TypeAlias

from gradagg.errors import GradaggError

Engine: TypeAlias = Literal["auto", "python", "numpy", "torch"]
ENGINES: tuple[str, ...] = ("auto", "python", "numpy", "torch")
_NONFINITE = ("propagate", "raise")


def owner_sum_columns(
    shard_ids: Any,
    worker_ids: Any = None,
    owner_ids: Any = None,
    gradients: Any = None,
    *,
    engine: str = "auto",
    nonfinite: str = "propagate",
) -> tuple[Any, Any]:
    """Sum each shard's gradient over the rows its owner contributed, on columns.

    Args:
        shard_ids: N shard ids: a NumPy array (integer, unicode ``<U`` or
            object holding ``str``/``int``), a torch tensor (integer), or a
            list. Alternatively a ``pyarrow.Table`` or ``RecordBatch`` with
            columns ``shard_id``, ``worker_id``, ``owner_id``, ``gradient``,
            passed alone: ``owner_sum_columns(table)``.
        worker_ids: N ids of the worker that produced each row (same kinds).
        owner_ids: N ids of each row's shard owner. A row counts only when its
            worker equals its owner.
        gradients: shape ``(N,)`` (scalar gradients) or ``(N, D)`` (vectors),
            integer or floating; never bool.
        engine: ``"auto"``, ``"python"``, ``"numpy"`` or ``"torch"``.
        nonfinite: ``"propagate"`` lets a counted NaN/Inf into its total;
            ``"raise"`` makes it an error naming the row and shard. Replica
            rows are never counted, so never checked.

    Returns:
        ``(shards, totals)``: the shards that have at least one owner row,
        sorted ascending, and their totals, shape ``(S,)`` or ``(S, D)``.

    Raises:
        GradaggError: a subclass naming the column, row and values at fault:
            mismatched column lengths (RowShapeError), gradient ndim > 2
            (GradientShapeError), bool or non-numeric gradients
            (GradientTypeError), missing, float or mixed int/str ids (IdError),
            a non-finite counted gradient with ``nonfinite="raise"``
            (NonFiniteGradientError), an unknown engine.

    >>> import numpy as np
    >>> shards, totals = owner_sum_columns(
    ...     np.array(["x", "x", "y"]), np.array(["a", "b", "c"]), np.array(["a", "a", "c"]), np.array([1.0, 9.0, 2.0]))
    >>> shards.tolist(), totals.tolist()
    (['x', 'y'], [1.0, 2.0])
    """
    acc = OwnerSumAccumulator(engine=engine, nonfinite=nonfinite)
    acc.update(shard_ids, worker_ids, owner_ids, gradients)
    return acc.result()


def microbatch_mean_columns(
    values: Any,
    present: Any = None,
    *,
    engine: str = "auto",
    nonfinite: str = "propagate",
) -> Any:
    """Mean of each parameter over all M microbatches; absence is explicit and counts as zero.

    Args:
        values: one of
            * an ``(M, P)`` NumPy array or torch tensor (row i = microbatch i);
            * a list of M lists of P items, each a tensor, an array, a number,
              or ``None`` where the parameter was absent (the shape of a
              training step's gradients: one tensor per parameter);
            * a ``pyarrow.Table`` or ``RecordBatch`` whose M columns are the
              microbatches (P rows each); a null is an absent value.
        present: for array input, an ``(M, P)`` boolean mask, True where the
            value is present; ``None`` means all present. NaN is a value,
            never a marker of absence.
        engine: ``"auto"``, ``"python"``, ``"numpy"`` or ``"torch"``.
        nonfinite: ``"propagate"`` or ``"raise"`` (names the microbatch and
            parameter of the first present non-finite value).

    Returns:
        float64 means ``sum_i(value[i, j] if present else 0) / M`` in the
        input's kind: a ``(P,)`` array/tensor, or for list input a list of P
        results (a 0-d zero where no microbatch revealed a parameter's shape).
        With M = 0 the result is empty, as in the reference.

    Raises:
        GradaggError: a ragged or mis-shaped input (RowShapeError,
            GradientShapeError), a bool/non-numeric value or mask
            (GradientTypeError), a non-finite value with
            ``nonfinite="raise"`` (NonFiniteGradientError).

    >>> import numpy as np
    >>> microbatch_mean_columns(np.array([[2.0, 0.0], [4.0, 6.0]]), np.array([[True, False], [True, True]])).tolist()
    [3.0, 3.0]
    """
    _check_options(engine, nonfinite)
    if _kind(values) == "arrow":
        values, present = _arrow_module().microbatch_columns(values)
    engine = resolve_engine(engine, _first_item(values))
    if _kind(values) == "list":
        return _backend(engine).microbatch_mean(values, None, nonfinite=nonfinite)
    convert = _Converter(engine, None, values)
    means = _backend(engine).microbatch_mean(
        convert.array_to_backend(values), convert.array_to_backend(present), nonfinite=nonfinite
    )
    return convert.values_back(means)


class _BatchFed:
    """What both accumulators share: the options, and the backend resolved on the first batch."""

    def __init__(self, *, engine: str = "auto", nonfinite: str = "propagate") -> None:
        _check_options(engine, nonfinite)
        self._engine = engine
        self._nonfinite = nonfinite
        self._impl: Any = None
        self._convert: _Converter | None = None

    @property
    def engine(self) -> str | None:
        """The engine in use: resolved on the first batch, ``None`` before it."""
        return None if self._impl is None else self._engine


class OwnerSumAccumulator(_BatchFed):
    """Owner-only shard reduction fed in batches of rows.

    Memory grows with the number of distinct shards (and, for small-range
    integer ids, with their range), not with the rows fed. Summation order:
    each shard's total is built by adding its owner gradients one at a time in
    the order the rows were fed, across all ``update`` calls, so the result is
    the same as one :func:`owner_sum_columns` call on the concatenated batches
    (bit-identical for the numpy engine and torch on CPU; see the module notes
    for CUDA). The ``"python"`` engine keeps every row (it is the oracle).

    Args:
        engine: as for :func:`owner_sum_columns`; ``"auto"`` is resolved on
            the first batch.
        nonfinite: ``"propagate"`` or ``"raise"``; row numbers in messages
            count from the first row of the first batch.

    >>> import numpy as np
    >>> acc = OwnerSumAccumulator()
    >>> acc.update(np.array([1, 1]), np.array([0, 1]), np.array([0, 0]), np.array([2, 9]))
    >>> acc.update(np.array([1, 2]), np.array([0, 5]), np.array([0, 5]), np.array([3, 4]))
    >>> [a.tolist() for a in acc.result()]
    [[1, 2], [5, 4]]
    """

    def update(self, shard_ids: Any, worker_ids: Any = None, owner_ids: Any = None, gradients: Any = None) -> None:
        """Feed a batch of rows: four columns, or one Arrow table/record batch.

        Args:
            shard_ids: as for :func:`owner_sum_columns` (or an Arrow table).
            worker_ids: as for :func:`owner_sum_columns`.
            owner_ids: as for :func:`owner_sum_columns`.
            gradients: as for :func:`owner_sum_columns`.

        Raises:
            GradaggError: as for :func:`owner_sum_columns`; also a batch whose
                id type or gradient shape differs from earlier batches.
        """
        for columns in _owner_columns(shard_ids, worker_ids, owner_ids, gradients):
            if self._impl is None:
                self._start(columns)
            assert self._convert is not None  # set by _start; for mypy
            self._impl.update(*self._convert.to_backend(columns))

    def result(self) -> tuple[Any, Any]:
        """Return ``(shards, totals)`` over every row fed so far (sorted shards).

        Returns:
            As for :func:`owner_sum_columns`; empty arrays before any batch.
        """
        if self._impl is None:
            self._start(_empty_owner_columns())
        assert self._convert is not None
        shards, totals = self._impl.result()
        return self._convert.shards_back(shards), self._convert.values_back(totals)

    def _start(self, columns: tuple[Any, Any, Any, Any]) -> None:
        self._engine = resolve_engine(self._engine, columns[3])
        self._convert = _Converter(self._engine, columns[0], columns[3])
        self._impl = _backend(self._engine).OwnerSumAccumulator(nonfinite=self._nonfinite)


class MicrobatchMeanAccumulator(_BatchFed):
    """The microbatch mean fed a few microbatches at a time.

    Keeps one float64 sum per parameter (memory O(P)) and the count M of
    microbatches fed; ``result()`` divides by that M, never by participation.
    For input split by *parameters* instead (e.g. row groups of P), each chunk
    is independent: call :func:`microbatch_mean_columns` per chunk and
    concatenate.

    Args:
        engine: as for :func:`microbatch_mean_columns`.
        nonfinite: ``"propagate"`` or ``"raise"``; microbatch numbers in
            messages count across updates.

    >>> import numpy as np
    >>> acc = MicrobatchMeanAccumulator()
    >>> acc.update(np.array([[2.0, 5.0]]), np.array([[True, False]]))
    >>> acc.update(np.array([[4.0, 6.0]]))
    >>> acc.result().tolist()
    [3.0, 3.0]
    """

    def update(self, values: Any, present: Any = None) -> None:
        """Feed k microbatches: ``values`` of shape ``(k, P)`` and their ``present`` mask.

        Args:
            values: an ``(k, P)`` array or tensor, or an Arrow table whose k
                columns are microbatches (nulls absent).
            present: ``(k, P)`` booleans, True where present; ``None`` = all.

        Raises:
            GradaggError: as for :func:`microbatch_mean_columns`; also a batch
                whose P differs from earlier batches.
        """
        if _kind(values) == "arrow":
            values, present = _arrow_module().microbatch_columns(values)
        if self._impl is None:
            self._impl = self._backend_for(values).MicrobatchMeanAccumulator(nonfinite=self._nonfinite)
            self._convert = _Converter(self._engine, None, values)
        assert self._convert is not None
        self._impl.update(self._convert.array_to_backend(values), self._convert.array_to_backend(present))

    def result(self) -> Any:
        """Return the ``(P,)`` float64 means over the microbatches fed (empty before any).

        Returns:
            As for :func:`microbatch_mean_columns`.
        """
        if self._impl is None:
            return _backend(resolve_engine(self._engine, [])).MicrobatchMeanAccumulator().result()
        assert self._convert is not None
        return self._convert.values_back(self._impl.result())

    def _backend_for(self, values: Any) -> Any:
        self._engine = resolve_engine(self._engine, _first_item(values))
        return _backend(self._engine)


def available_engines() -> tuple[str, ...]:
    """The engines usable here: ``"python"`` always, then the installed backends.

    Returns:
        A tuple such as ``("python", "numpy", "torch")``.

    >>> "python" in available_engines()
    True
    """
    names = ["python"]
    for name in ("numpy", "torch"):
        if _importable(name):
            names.append(name)
    return tuple(names)


def resolve_engine(engine: str, sample: Any) -> str:
    """Turn ``engine`` (maybe ``"auto"``) into the backend that will run ``sample``.

    Args:
        engine: one of :data:`ENGINES`.
        sample: the gradients column (or values), whose kind decides ``"auto"``.

    Returns:
        ``"python"``, ``"numpy"`` or ``"torch"``.

    Raises:
        GradaggError: an unknown engine, or one whose framework is not installed.

    >>> resolve_engine("python", [1.0])
    'python'
    """
    if engine not in ENGINES:
        raise GradaggError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    if engine == "auto":
        if _kind(sample) == "torch":
            return "torch"
        return "numpy" if _importable("numpy") else "python"
    if engine != "python" and not _importable(engine):
        raise GradaggError(f"engine={engine!r} needs the {engine} package, which is not installed")
    return engine


# --- inputs --------------------------------------------------------------------


def _kind(x: Any) -> str:
    """Classify an input without importing any framework: by its type's module."""
    root = type(x).__module__.split(".")[0]
    if root in ("torch", "numpy", "pyarrow"):
        return {"pyarrow": "arrow"}.get(root, root)
    if isinstance(x, (list, tuple)):
        return "list"
    return "other"


def _first_item(values: Any) -> Any:
    """The first non-None leaf of a list-of-lists input (its kind decides ``auto``)."""
    if _kind(values) != "list":
        return values
    for row in values:
        for item in row if isinstance(row, (list, tuple)) else [row]:
            if item is not None:
                return item
    return values


def _owner_columns(shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> Iterator[tuple[Any, ...]]:
    """Yield ``(shards, workers, owners, gradients)`` batches: one, or one per Arrow record batch."""
    if _kind(shard_ids) == "arrow":
        if not (worker_ids is None and owner_ids is None and gradients is None):
            raise GradaggError("pass an Arrow table alone: owner_sum_columns(table), not with other columns")
        yield from _arrow_module().owner_columns(shard_ids)
        return
    named = (("worker_ids", worker_ids), ("owner_ids", owner_ids), ("gradients", gradients))
    missing = [name for name, column in named if column is None]
    if missing:
        raise GradaggError(f"missing column(s) {', '.join(missing)}: pass four columns, or one Arrow table alone")
    yield shard_ids, worker_ids, owner_ids, gradients


def _empty_owner_columns() -> tuple[Any, Any, Any, Any]:
    return [], [], [], []


def _check_options(engine: str, nonfinite: str) -> None:
    if engine not in ENGINES:
        raise GradaggError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    if nonfinite not in _NONFINITE:
        raise GradaggError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")


class _Converter:
    """Moves columns into the chosen backend's array kind and results back to the input's kind."""

    def __init__(self, engine: str, shard_sample: Any, value_sample: Any) -> None:
        self.engine = engine
        self.shard_kind = _kind(shard_sample)
        self.value_kind = _kind(value_sample)
        self.device = getattr(value_sample, "device", None) if self.value_kind == "torch" else None

    def to_backend(self, columns: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(self.array_to_backend(c) for c in columns)

    def array_to_backend(self, x: Any) -> Any:
        if x is None or self.engine == "python":
            return x
        kind = _kind(x)
        if self.engine == "numpy" and kind == "torch":
            return x.detach().cpu().numpy()
        if self.engine == "torch" and kind in ("numpy", "list"):
            return _torch_backend().as_tensor(x)
        return x

    def shards_back(self, shards: Any) -> Any:
        return self._back(shards, self.shard_kind)

    def values_back(self, values: Any) -> Any:
        return self._back(values, self.value_kind)

    def _back(self, x: Any, kind: str) -> Any:
        have = _kind(x)
        if kind == "torch" and have != "torch":
            return _torch_backend().as_tensor(x, device=self.device)
        if kind != "torch" and have == "torch":
            return x.cpu().numpy()
        return x


# --- backends --------------------------------------------------------------------


def _backend(engine: str) -> Any:
    """Import and return the backend module for a resolved engine name."""
    import importlib

    return importlib.import_module(f"gradagg.backends.{engine}")


def _torch_backend() -> Any:
    return _backend("torch")


def _arrow_module() -> Any:
    import importlib

    return importlib.import_module("gradagg.formats.arrow")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
