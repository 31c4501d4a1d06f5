"""Both contracts on columns, rows or batches: the one place that chooses a backend and converts between frameworks.

The contracts are those of :mod:`gradagg.reference` (read its vocabulary first):

* :func:`owner_sum_columns` / :func:`microbatch_mean_columns`: on NumPy arrays,
  torch tensors, Python lists or one Arrow table;
* :func:`owner_sum_rows` / :func:`microbatch_mean_rows`: on the reference's own
  rows, with its answers and its messages, on any engine;
* :func:`owner_sum_batches` / :func:`microbatch_mean_batches` and the two
  accumulators: the same fed batch by batch (a Parquet file's record batches),
  in memory that grows with the distinct shards (resp. parameters), not rows.

Engines (``engine=``): ``"python"`` is the reference itself (slow, obviously
right); ``"numpy"`` is :mod:`gradagg.backends.numpy` (fused one-pass kernels
when numba is installed, the same answers without); ``"torch"`` is
:mod:`gradagg.backends.torch` on the tensors' device, except that CPU tensors
run on the NumPy kernels through zero-copy views when those are compiled
(:data:`CPU_TENSORS_VIA_NUMPY`: the fastest CPU path, the same bits);
``"auto"`` picks ``"torch"`` for torch tensors, ``"numpy"`` for everything else
(``"python"`` without NumPy), and the reference for rows.

Results come back in the input's kind: NumPy in, NumPy out; torch in, torch out
(totals on the gradients' device, integer shards as the shard ids were; string
shards are always a NumPy object array of the strings, since a ``<U`` array
would drop trailing NULs). Totals are int64 for integer gradients, float64 for
floating ones (float32 summed in float64, as the reference sums Python floats).

Numbers: on CPU every engine adds a shard's owner gradients one by one in row
order from the first, so float totals are bit-identical to the reference; on
CUDA (atomic adds) each total is within ``2 * (n - 1) * 2**-53 * sum(|g|)`` of
it over the shard's n owner rows. Integer totals are exact while they fit in
int64; what the backends cannot hold exactly (an overflow risk, integers beyond
int64, integers above 2**53 mixed with floats) is a clear error that suggests
``engine="python"``, never a rounded answer.

Importing this module imports neither NumPy nor torch: each loads when needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from gradagg import reference
from gradagg.errors import GradaggError
from gradagg.options import ENGINES, check_engine, check_nonfinite

CPU_TENSORS_VIA_NUMPY: bool | None = None
"""Run torch CPU tensors on the NumPy kernels (zero-copy): None = when numba compiled them; tests set it."""


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
        shard_ids: N int or str ids (a NumPy array, a torch tensor of ints, a
            list), or a ``pyarrow.Table`` / ``RecordBatch`` with columns
            ``shard_id, worker_id, owner_id, gradient`` passed alone.
        worker_ids: N ids of the worker that produced each row.
        owner_ids: N ids of each row's shard owner (the kind of ``worker_ids``);
            a row counts only when its worker equals its owner.
        gradients: ``(N,)`` or ``(N, D)`` integers or floats, never bool.
        engine: ``"auto"``, ``"python"``, ``"numpy"`` or ``"torch"``.
        nonfinite: ``"propagate"`` or ``"raise"`` (a counted NaN/Inf is an error
            naming its row and shard; replica rows are never checked).

    Returns:
        ``(shards, totals)``: the shards with an owner row, sorted, and their
        totals of shape ``(S,)`` or ``(S, D)``.

    Raises:
        GradaggError: a subclass naming the column, row and values at fault
            (lengths, shapes, bool or non-numeric gradients, missing, float or
            mixed ids, a counted NaN with ``"raise"``, an unknown engine).

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
    values: Any, present: Any = None, *, engine: str = "auto", nonfinite: str = "propagate"
) -> Any:
    """Mean of each parameter over all M microbatches; absence is explicit and counts as zero.

    Args:
        values: an ``(M, P)`` NumPy array or torch tensor (row i = microbatch
            i); or a list of M lists of P items (tensors, arrays, numbers, or
            ``None`` where absent); or an Arrow table of M microbatch columns
            (null = absent).
        present: for array input, ``(M, P)`` booleans, True where present;
            ``None`` = all present. NaN is a value, never a marker of absence.
        engine: ``"auto"``, ``"python"``, ``"numpy"`` or ``"torch"``.
        nonfinite: ``"propagate"`` or ``"raise"`` (names the first present
            NaN/Inf's microbatch and parameter).

    Returns:
        float64 means ``sum_i(value[i, j] if present else 0) / M`` in the
        input's kind; for list input a list of P results (a 0-d zero where no
        microbatch showed a parameter's shape); empty when M = 0.

    Raises:
        GradaggError: a ragged or mis-shaped input, a bool/non-numeric value
            or mask, a counted NaN/Inf with ``"raise"``.

    >>> import numpy as np
    >>> microbatch_mean_columns(np.array([[2.0, 0.0], [4.0, 6.0]]), np.array([[True, False], [True, True]])).tolist()
    [3.0, 3.0]
    """
    acc = MicrobatchMeanAccumulator(engine=engine, nonfinite=nonfinite)
    if _kind(values) == "list":
        return acc._mean_of_lists(values)
    acc.update(values, present)
    return acc.result()


def owner_sum_rows(
    rows: Sequence[Sequence[object]], *, engine: str = "auto", nonfinite: str = "propagate"
) -> list[list[object]]:
    """Owner-only shard reduction over the reference's rows, on any engine, with the reference's answer.

    Args:
        rows: ``(shard_id, worker_id, owner_id, gradient)`` rows, as for
            :func:`gradagg.reference.owner_sum`.
        engine: ``"auto"`` and ``"python"`` run the reference on the rows
            themselves; ``"numpy"`` and ``"torch"`` turn them into columns
            once (:mod:`gradagg.backends._rows`) and run that backend.
        nonfinite: ``"propagate"`` or ``"raise"``.

    Returns:
        ``[[shard_id, total], ...]`` sorted by shard, equal to the reference's:
        a total is an exact ``int`` where all its counted gradients are ints
        (element by element for vectors), else a float summed in row order.

    Raises:
        GradaggError: every input the reference refuses, with the reference's
            message; on numpy/torch also what they cannot hold exactly (ints
            beyond int64, ints above 2**53 mixed with floats in one shard,
            vectors of several lengths), saying so and naming the row or shard.

    >>> owner_sum_rows([["x", "a", "a", 1], ["y", "a", "a", 0.5], ["x", "a", "a", 2**53 + 1]], engine="numpy")
    [['x', 9007199254740994], ['y', 0.5]]
    """
    engine, nonfinite = check_engine(engine), check_nonfinite(nonfinite)
    if engine in ("auto", "python"):
        return reference.owner_sum(rows, nonfinite=nonfinite)

    def run(shards: Any, workers: Any, owners: Any, gradients: Any) -> tuple[list[Any], list[Any]]:
        s, t = owner_sum_columns(shards, workers, owners, gradients, engine=engine, nonfinite=nonfinite)
        return python_values(s), python_values(t)

    try:
        return _import("gradagg.backends._rows").owner_sum(rows, run)  # type: ignore[no-any-return]
    except GradaggError:
        reference.owner_sum(rows, nonfinite=nonfinite)  # the reference's own message, when it refuses the rows too
        raise


def microbatch_mean_rows(
    rows: Sequence[Sequence[object]],
    active_counts: Sequence[int] | None = None,
    *,
    engine: str = "auto",
    nonfinite: str = "propagate",
) -> list[float]:
    """The microbatch mean over the reference's rows (``None`` = absent), on any engine, with its answer.

    Args:
        rows: M microbatches of P numbers or ``None``, as for
            :func:`gradagg.reference.microbatch_mean`.
        active_counts: participation counters, checked as the reference
            checks them; never a divisor.
        engine: ``"auto"`` and ``"python"`` run the reference; ``"numpy"`` and
            ``"torch"`` turn the rows into ``(M, P)`` values and a ``present``
            mask once.
        nonfinite: ``"propagate"`` or ``"raise"``.

    Returns:
        P floats ``sum_i (rows[i][j] or 0) / M``, equal to the reference's.

    Raises:
        GradaggError: every input the reference refuses, with its message; on
            numpy/torch also integers a float64 sum would round.

    >>> microbatch_mean_rows([[2, None], [4, 6]], [1, 2], engine="numpy")
    [3.0, 3.0]
    """
    engine, nonfinite = check_engine(engine), check_nonfinite(nonfinite)
    if engine in ("auto", "python"):
        return reference.microbatch_mean(rows, active_counts, nonfinite=nonfinite)
    reference.microbatch_mean([], active_counts)  # the counters' check, the reference's own (never a divisor)

    def run(values: Any, present: Any) -> list[Any]:
        return python_values(microbatch_mean_columns(values, present, engine=engine, nonfinite=nonfinite))

    try:
        return _import("gradagg.backends._rows").microbatch_mean(rows, run)  # type: ignore[no-any-return]
    except GradaggError:
        reference.microbatch_mean(rows, active_counts, nonfinite=nonfinite)
        raise


def owner_sum_batches(
    batches: Iterable[tuple[Any, Any, Any, Any]], *, engine: str = "auto", nonfinite: str = "propagate"
) -> tuple[Any, Any]:
    """Owner-only shard reduction over batches of four columns (e.g. a Parquet file's record batches).

    Args:
        batches: ``(shard_ids, worker_ids, owner_ids, gradients)`` tuples, as
            for :func:`owner_sum_columns`, consumed one at a time.
        engine: as for :func:`owner_sum_columns` (``"auto"`` resolved on the first batch).
        nonfinite: ``"propagate"`` or ``"raise"``; rows are numbered from the first batch's first row.

    Returns:
        ``(shards, totals)`` over every row of every batch, as one call on their concatenation.

    Raises:
        GradaggError: as for :func:`owner_sum_columns`, and whatever ``batches`` raises.

    >>> import numpy as np
    >>> one = (np.array([1]), np.array([0]), np.array([0]), np.array([2]))
    >>> [a.tolist() for a in owner_sum_batches([one, one])]
    [[1], [4]]
    """
    acc = OwnerSumAccumulator(engine=engine, nonfinite=nonfinite)
    for columns in batches:
        acc.update(*columns)
    return acc.result()


def microbatch_mean_batches(
    batches: Iterable[tuple[Any, Any]], *, engine: str = "auto", nonfinite: str = "propagate"
) -> Any:
    """The mean over batches of *parameters*: each ``(values, present)`` holds every microbatch of some parameters.

    This is how a Parquet mean file streams (one row per parameter): a batch
    of parameters is complete in itself, so each is reduced on its own and the
    means are concatenated; every batch has the same M, the divisor.

    Args:
        batches: ``(values, present)`` pairs of shape ``(M, p_k)``, as for
            :func:`microbatch_mean_columns`.
        engine: as for :func:`microbatch_mean_columns`.
        nonfinite: ``"propagate"`` or ``"raise"``; parameters are numbered across batches.

    Returns:
        The float64 means of all parameters, in order, as one array (NumPy, or torch for tensors).

    Raises:
        GradaggError: as for :func:`microbatch_mean_columns`; batches with different M.

    >>> import numpy as np
    >>> microbatch_mean_batches([(np.array([[1.0], [3.0]]), None), (np.array([[2.0], [4.0]]), None)]).tolist()
    [2.0, 3.0]
    """
    parts: list[Any] = []
    route: _Route | None = None
    count, m = 0, None
    for values, present in batches:
        route = route or _Route(engine, None, values)
        if m is not None and len(values) != m:
            raise GradaggError(f"parameter {count}: a batch of {len(values)} microbatches after batches of {m}")
        m = len(values)
        parts.append(route.backend.microbatch_mean(
            route.numbers_in(values), route.numbers_in(present), nonfinite=check_nonfinite(nonfinite),
            parameter_offset=count,
        ))
        count += values.shape[1]
    route = route or _Route(engine, None, [])
    return route.values_out(route.concatenate(parts))


class _BatchFed:
    """What both accumulators share: the options, and the route (backend, conversions) set on the first batch."""

    def __init__(self, *, engine: str = "auto", nonfinite: str = "propagate") -> None:
        self._engine = check_engine(engine)
        self._nonfinite = check_nonfinite(nonfinite)
        self._route: _Route | None = None
        self._impl: Any = None

    @property
    def engine(self) -> str | None:
        """The engine in use: resolved on the first batch, ``None`` before it."""
        return None if self._route is None else self._route.name


class OwnerSumAccumulator(_BatchFed):
    """Owner-only shard reduction fed in batches of rows.

    Each shard's total adds its owner gradients one at a time in the order
    rows were fed, across ``update`` calls: the result is that of one
    :func:`owner_sum_columns` call on the concatenated batches (bit for bit on
    CPU). Memory grows with the distinct shards, except on ``"python"``, which
    keeps every row (it is the oracle).

    Args:
        engine: as for :func:`owner_sum_columns`; ``"auto"`` is resolved on the first batch.
        nonfinite: ``"propagate"`` or ``"raise"``; rows are numbered from the first batch's first row.

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
            GradaggError: as for :func:`owner_sum_columns`; also a batch whose id
                type or gradient shape differs from earlier batches.
        """
        for shards, workers, owners, grads in _owner_columns(shard_ids, worker_ids, owner_ids, gradients):
            if self._route is None:
                self._route = _Route(self._engine, shards, grads)
                self._impl = self._route.backend.OwnerSumAccumulator(nonfinite=self._nonfinite)
            r = self._route
            self._impl.update(r.ids_in(shards), r.ids_in(workers), r.ids_in(owners), r.numbers_in(grads))

    def result(self) -> tuple[Any, Any]:
        """Return ``(shards, totals)`` over every row fed so far (shards sorted).

        Returns:
            As for :func:`owner_sum_columns`; empty arrays before any batch.
        """
        if self._route is None:
            self.update([], [], [], [])
        assert self._route is not None  # set by update; for mypy
        shards, totals = self._impl.result()
        return self._route.ids_out(shards), self._route.values_out(totals)


class MicrobatchMeanAccumulator(_BatchFed):
    """The microbatch mean fed a few microbatches at a time.

    Keeps one float64 sum per parameter and the count M of microbatches fed;
    ``result()`` divides by that M, never by participation. For input split by
    parameters instead, see :func:`microbatch_mean_batches`.

    Args:
        engine: as for :func:`microbatch_mean_columns`.
        nonfinite: ``"propagate"`` or ``"raise"``; microbatches are numbered across updates.

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
            values: a ``(k, P)`` array or tensor, or an Arrow table whose k
                columns are microbatches (nulls absent).
            present: ``(k, P)`` booleans, True where present; ``None`` = all.

        Raises:
            GradaggError: as for :func:`microbatch_mean_columns`; also a batch
                whose P differs from earlier batches.
        """
        if _kind(values) == "arrow":
            values, present = _import("gradagg.formats.arrow").microbatch_columns(values)
        if self._route is None:
            self._route = _Route(self._engine, None, values)
            self._impl = self._route.backend.MicrobatchMeanAccumulator(nonfinite=self._nonfinite)
        self._impl.update(self._route.numbers_in(values), self._route.numbers_in(present))

    def result(self) -> Any:
        """Return the ``(P,)`` float64 means over the microbatches fed (empty before any).

        Returns:
            As for :func:`microbatch_mean_columns`.
        """
        if self._route is None:
            self._route = _Route(self._engine, None, [])
            self._impl = self._route.backend.MicrobatchMeanAccumulator(nonfinite=self._nonfinite)
        return self._route.values_out(self._impl.result())

    def _mean_of_lists(self, rows: Any) -> list[Any]:
        """The list-of-lists form of :func:`microbatch_mean_columns` (one call, not fed in batches)."""
        self._route = route = _Route(self._engine, None, _first_item(rows))
        items = [[None if v is None else route.numbers_in(v) for v in row] for row in rows]
        means = route.backend.microbatch_mean(items, None, nonfinite=self._nonfinite)
        return [route.values_out(m) for m in means]


def python_values(x: Any) -> list[Any]:
    """Plain Python numbers and strings from a NumPy array, a torch tensor (any device) or a list.

    Args:
        x: a result of this module (shards, totals or means).

    Returns:
        A (nested) list of ``int``, ``float`` and ``str``, as JSON and CSV writers want.

    >>> import numpy as np
    >>> python_values(np.array([1.5, 2.0], dtype=np.float32)), python_values(["a"])
    ([1.5, 2.0], ['a'])
    """
    if _kind(x) == "torch":
        x = x.detach().cpu()
    return x.tolist() if hasattr(x, "tolist") else list(x)  # type: ignore[no-any-return]


def available_engines() -> tuple[str, ...]:
    """The engines usable here: ``"python"`` always, then the installed backends.

    Returns:
        A tuple such as ``("python", "numpy", "torch")``.

    >>> "python" in available_engines()
    True
    """
    return ("python", *(name for name in ("numpy", "torch") if _importable(name)))


def resolve_engine(engine: str, sample: Any) -> str:
    """Turn ``engine`` (maybe ``"auto"``) into the engine that will run ``sample``.

    Args:
        engine: one of :data:`gradagg.options.ENGINES`.
        sample: the gradients column (or values), whose kind decides ``"auto"``.

    Returns:
        ``"python"``, ``"numpy"`` or ``"torch"``; for buffer columns (the native
        Parquet reader's, ``memoryview``, ``array.array``) ``"auto"`` is
        ``"native"`` (:mod:`gradagg.backends.native`, compiled) where it is built.

    Raises:
        GradaggError: an unknown engine, or one whose framework is not installed.

    >>> resolve_engine("python", [1.0])
    'python'
    """
    if check_engine(engine) == "auto":
        kind = _kind(sample)
        if kind == "torch":
            return "torch"
        if kind == "buffer" and _import("gradagg.backends.native").available():
            return "native"
        return "numpy" if _importable("numpy") else "python"
    if engine != "python" and not _importable(engine):
        raise GradaggError(f"engine={engine!r} needs the {engine} package, which is not installed")
    return engine


# --- backend choice and conversions: nothing else in gradagg does either --------------------------


class _Route:
    """The backend for a call and the conversions in and out of it, decided once from the first batch."""

    def __init__(self, engine: str, ids_sample: Any, values_sample: Any) -> None:
        self.name = resolve_engine(engine, values_sample)
        self.ids_kind, self.values_kind = _kind(ids_sample), _kind(values_sample)
        self.ids_device = ids_sample.device if self.ids_kind == "torch" else None
        self.device = values_sample.device if self.values_kind == "torch" else None
        on_cpu = self.device is None or self.device.type == "cpu"
        self.backend_name = "numpy" if self.name == "torch" and on_cpu and _cpu_tensors_via_numpy() else self.name
        self.backend = _import(f"gradagg.backends.{self.backend_name}")

    def ids_in(self, x: Any) -> Any:
        """Ids for the backend: NumPy for numpy (torch viewed without a copy on CPU); else as given."""
        if _kind(x) == "buffer" and self.backend_name not in ("native", "python"):
            return _numpy_of_buffer(x)
        return _numpy_of(x) if self.backend_name == "numpy" and _kind(x) == "torch" else x

    def numbers_in(self, x: Any) -> Any:
        """Gradients, values or masks in the backend's array kind (``None`` stays ``None``)."""
        if x is None or self.backend_name in ("python", "native"):
            return x
        if _kind(x) == "buffer":
            x = _numpy_of_buffer(x)
        if self.backend_name == "numpy":
            return _numpy_of(x) if _kind(x) == "torch" else x
        return x if _kind(x) == "torch" else _tensor_of(x, self.device)

    def ids_out(self, shards: Any) -> Any:
        """Integer shards as the shard ids came (tensor or NumPy); string shards stay NumPy objects."""
        if self.ids_kind == "torch" and _kind(shards) == "numpy" and shards.dtype.kind in "iu":
            return _tensor_of(shards, self.ids_device)
        return _numpy_of(shards) if self.ids_kind != "torch" and _kind(shards) == "torch" else shards

    def values_out(self, values: Any) -> Any:
        """Totals or means as the gradients came: a tensor on their device, or NumPy."""
        if self.values_kind == "torch" and _kind(values) == "numpy":
            return _tensor_of(values, self.device)
        return _numpy_of(values) if self.values_kind != "torch" and _kind(values) == "torch" else values

    def concatenate(self, parts: list[Any]) -> Any:
        if parts and _kind(parts[0]) == "torch":
            return _import("torch").cat(parts)
        np = _import("numpy")
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)


def _cpu_tensors_via_numpy() -> bool:
    if CPU_TENSORS_VIA_NUMPY is not None:
        return CPU_TENSORS_VIA_NUMPY
    return bool(_import("gradagg.backends._kernels").AVAILABLE)


def _numpy_of(t: Any) -> Any:
    """A NumPy array of a tensor: a zero-copy view on CPU, a host copy otherwise."""
    return t.detach().cpu().numpy() if _kind(t) == "torch" else t


def _tensor_of(x: Any, device: Any) -> Any:
    """A tensor of NumPy or Python numbers, checked first (bools, strings, beyond int64) by the NumPy checks."""
    torch, np, checks = _import("torch"), _import("numpy"), _import("gradagg.backends._checks")
    if isinstance(x, np.ndarray):
        x = x if x.dtype.kind in "biuf" else checks.widen(x, "values")
    elif not (len(x) and all(isinstance(v, bool) for v in x)):  # a list of bools is a mask; else numbers
        x = checks.as_gradients(x, "values")
    else:
        x = np.array(x, dtype=bool)
    if not x.flags.writeable or not x.flags.c_contiguous:  # torch.from_numpy wants writable, contiguous memory
        x = np.array(x)
    t = torch.from_numpy(x)
    return t if device is None else t.to(device)


def _kind(x: Any) -> str:
    """Classify an input without importing any framework: by its type's module.

    ``"buffer"``: a typed ``memoryview``, an ``array.array``, or a dictionary-encoded
    buffer column (``values`` a memoryview, ``indices`` one or None), as the native
    Parquet reader yields (:class:`gradagg.formats.parquet_native.Column`).
    """
    root = type(x).__module__.split(".")[0]
    if root in ("torch", "numpy", "pyarrow"):
        return {"pyarrow": "arrow"}.get(root, root)
    if isinstance(x, memoryview) or root == "array" or isinstance(getattr(x, "values", None), memoryview):
        return "buffer"
    return "list" if isinstance(x, (list, tuple)) else "other"


def _numpy_of_buffer(x: Any) -> Any:
    """A NumPy array of a buffer column (a view; a dictionary-encoded column is taken through its indices)."""
    np = _import("numpy")
    values = memoryview(getattr(x, "values", x))
    array = np.frombuffer(values, dtype=np.dtype(values.format)) if values.nbytes else np.empty(
        0, dtype=np.dtype(values.format))
    indices = getattr(x, "indices", None)
    return array if indices is None else array.take(np.frombuffer(memoryview(indices), dtype=np.uint32))


def _first_item(values: Any) -> Any:
    """The first non-None leaf of a list-of-lists input (its kind decides ``auto``)."""
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
        yield from _import("gradagg.formats.arrow").owner_columns(shard_ids)
        return
    named = (("worker_ids", worker_ids), ("owner_ids", owner_ids), ("gradients", gradients))
    missing = [name for name, column in named if column is None]
    if missing:
        raise GradaggError(f"missing column(s) {', '.join(missing)}: pass four columns, or one Arrow table alone")
    yield shard_ids, worker_ids, owner_ids, gradients


def _import(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


def _importable(name: str) -> bool:
    import sys

    if name in sys.modules:  # the common case (NumPy arrays in hand): no search of the path
        return True
    import importlib.util

    return importlib.util.find_spec(name) is not None


__all__ = [
    "CPU_TENSORS_VIA_NUMPY",
    "ENGINES",
    "MicrobatchMeanAccumulator",
    "OwnerSumAccumulator",
    "available_engines",
    "microbatch_mean_batches",
    "microbatch_mean_columns",
    "microbatch_mean_rows",
    "owner_sum_batches",
    "owner_sum_columns",
    "owner_sum_rows",
    "python_values",
    "resolve_engine",
]
