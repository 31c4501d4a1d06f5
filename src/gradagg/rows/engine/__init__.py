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
right); ``"numpy"`` is :mod:`gradagg.rows.backends.numpy`, pure NumPy;
``"numba"`` is :mod:`gradagg.rows.backends.numba`, the same backend with fused
numba kernels (same answers, bit for bit; needs the ``jit`` extra);
``"torch"`` is :mod:`gradagg.rows.backends.torch_tensors` on the tensors' device;
``"auto"`` picks ``"torch"`` for torch tensors, ``"numba"`` for NumPy arrays
and Arrow tables where numba is installed, ``"numpy"`` for everything else
(``"python"`` without NumPy), and the reference for rows. That is the whole choice: an
explicit argument and the input's type, made in :mod:`gradagg.rows.engine._route`
(the conversions too); the accumulators live in :mod:`gradagg.rows.engine.accumulators`.

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

from collections.abc import Iterable, Sequence
from typing import Any

from gradagg import reference
from gradagg.errors import GradaggError, RowShapeError
from gradagg.options import ENGINES, check_engine, check_nonfinite
from gradagg.rows.engine._route import Route, backend, importable, kind
from gradagg.rows.engine.accumulators import ColumnarMean, ColumnarOwnerSum


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
        engine: ``"auto"``, ``"python"``, ``"numpy"``, ``"numba"`` or ``"torch"``.
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
    acc = ColumnarOwnerSum(engine=engine, nonfinite=nonfinite)
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
        engine: ``"auto"``, ``"python"``, ``"numpy"``, ``"numba"`` or ``"torch"``.
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
    acc = ColumnarMean(engine=engine, nonfinite=nonfinite)
    if kind(values) == "list":
        return acc._mean_of_lists(values if present is None else _absent_where_not_present(values, present))
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
            themselves; ``"numpy"``, ``"numba"`` and ``"torch"`` turn them into columns
            once (:mod:`gradagg.rows.backends._rows`) and run that backend.
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
            Where such a limit comes first in row order, its message is the
            one raised (the reference is re-read only up to the row it names).

    >>> owner_sum_rows([["x", "a", "a", 1], ["y", "a", "a", 0.5], ["x", "a", "a", 2**53 + 1]], engine="numpy")
    [['x', 9007199254740994], ['y', 0.5]]
    """
    engine, nonfinite = check_engine(engine), check_nonfinite(nonfinite)
    if engine in ("auto", "python"):
        return reference.owner_sum(rows, nonfinite=nonfinite)

    def run(shards: Any, workers: Any, owners: Any, gradients: Any) -> tuple[list[Any], list[Any]]:
        s, t = owner_sum_columns(shards, workers, owners, gradients, engine=engine, nonfinite=nonfinite)
        return python_values(s), python_values(t)

    backend(engine)  # a missing framework is named before anything imports NumPy
    from gradagg.rows.backends import _rows  # (NumPy: imported only for a fast engine)

    try:
        return _rows.owner_sum(rows, run)
    except GradaggError as exc:
        # The reference's own message where it refuses these rows too: it reads rows in order, so it refuses
        # them by the row the engine names (then only that far is re-read), or only at the end.
        reference.owner_sum(_up_to_named_row(rows, exc, "row"), nonfinite=nonfinite)
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
        engine: ``"auto"`` and ``"python"`` run the reference; ``"numpy"``,
            ``"numba"`` and ``"torch"`` turn the rows into ``(M, P)`` values and a ``present``
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

    backend(engine)
    from gradagg.rows.backends import _rows

    try:
        return _rows.microbatch_mean(rows, run)
    except GradaggError as exc:
        reference.microbatch_mean(_up_to_named_row(rows, exc, "microbatch"), nonfinite=nonfinite)
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
    acc = ColumnarOwnerSum(engine=engine, nonfinite=nonfinite)
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
    route: Route | None = None
    count, m = 0, None
    for values, present in batches:
        route = route or Route(engine, None, values)
        if m is not None and len(values) != m:
            raise GradaggError(f"parameter {count}: a batch of {len(values)} microbatches after batches of {m}")
        m = len(values)
        parts.append(route.backend.microbatch_mean(
            route.numbers_in(values), route.numbers_in(present), nonfinite=check_nonfinite(nonfinite),
            parameter_offset=count,
        ))
        count += values.shape[1]
    route = route or Route(engine, None, [])
    return route.values_out(route.concatenate(parts))


def _up_to_named_row(rows: Sequence[Sequence[object]], exc: GradaggError, what: str) -> Sequence[Sequence[object]]:
    """The rows up to the last one an error message names ("row 0: ... but row 1's ..."), or all of them."""
    import re

    named = [int(n) for n in re.findall(rf"\b{what} (\d+)", str(exc))]
    return rows[: max(named) + 1] if named else rows


def _absent_where_not_present(rows: Any, present: Any) -> list[list[Any]]:
    """List input with a mask: ``None`` where the mask is False, once the shapes are seen to match."""
    mask = python_values(present)
    if _shape(mask) != _shape(rows):
        raise RowShapeError(f"present has shape {_shape(mask)}, values have shape {_shape(rows)}; they must match")
    return [[v if keep else None for v, keep in zip(row, keeps)] for row, keeps in zip(rows, mask)]


def _shape(rows: list[Any]) -> tuple[int, ...]:
    lengths = {len(r) if isinstance(r, (list, tuple)) else -1 for r in rows}
    return (len(rows), lengths.pop()) if len(lengths) == 1 and -1 not in lengths else (len(rows),)


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
    if kind(x) == "torch":
        x = x.detach().cpu()
    return x.tolist() if hasattr(x, "tolist") else list(x)  # type: ignore[no-any-return]


def available_engines() -> tuple[str, ...]:
    """The engines usable here: ``"python"`` always, then the installed backends.

    Returns:
        A tuple such as ``("python", "numpy", "numba", "torch")`` (numba needs NumPy too).

    >>> "python" in available_engines()
    True
    """
    needs = {"numpy": ("numpy",), "numba": ("numpy", "numba"), "torch": ("torch",)}
    return ("python", *(name for name, frameworks in needs.items() if all(map(importable, frameworks))))


__all__ = [
    "ENGINES",
    "ColumnarMean",
    "ColumnarOwnerSum",
    "available_engines",
    "microbatch_mean_batches",
    "microbatch_mean_columns",
    "microbatch_mean_rows",
    "owner_sum_batches",
    "owner_sum_columns",
    "owner_sum_rows",
    "python_values",
]
