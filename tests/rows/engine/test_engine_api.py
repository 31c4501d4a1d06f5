"""The columnar API's shape: engine choice, lazy imports, Arrow input, and errors that name where and what."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

import gradagg
import gradagg.rows
from gradagg import reference
from gradagg.errors import (
    FormatError,
    GradaggError,
    GradientShapeError,
    GradientTypeError,
    IdError,
    RowShapeError,
    UnorderableShardError,
)
from gradagg.rows.backends import numpy as numpy_backend
from gradagg.rows.backends import python as python_backend
from gradagg.rows.backends import torch_tensors as torch_backend
from gradagg.rows.engine import (
    ColumnarOwnerSum,
    available_engines,
    microbatch_mean_columns,
    owner_sum_columns,
)
from gradagg.rows.engine._route import resolve_engine
from tests.rows.engine.engine_inputs import IMPLS, JIT, NUMPY_LIKE

ROOT = Path(__file__).resolve().parents[3]


def python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (imports are process-wide) and return its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_gradagg_loads_no_framework() -> None:
    """``import gradagg`` (and the rows package, its engine and backends) imports neither NumPy nor torch."""
    out = python(
        "import sys, gradagg, gradagg.rows, gradagg.rows.engine, gradagg.rows.backends; "
        "print(sorted(m for m in ('numpy', 'torch', 'pyarrow') if m in sys.modules))"
    )
    assert out == "[]"


def test_numpy_input_does_not_import_torch() -> None:
    """NumPy in, auto engine: torch is never loaded (it costs seconds of start-up)."""
    out = python(
        "import sys, numpy as np, gradagg.rows; "
        "s, t = gradagg.rows.owner_sum_columns(np.array([1]), np.array([0]), np.array([0]), np.array([2.0])); "
        "print(t.tolist(), 'torch' in sys.modules)"
    )
    assert out == "[2.0] False"


def test_moved_names_and_backend_symmetry() -> None:
    """gradagg.rows exposes the columnar API; the core's old names point there; every backend has the same names."""
    assert gradagg.rows.owner_sum_columns is owner_sum_columns
    assert gradagg.rows.microbatch_mean_columns is microbatch_mean_columns
    for name in ("owner_sum_columns", "microbatch_mean_columns"):
        with pytest.raises(AttributeError, match=f"gradagg.{name} is now gradagg.rows.{name}"):
            getattr(gradagg, name)
    jit = [importlib.import_module("gradagg.rows.backends.numba")] if JIT else []
    for module in (numpy_backend, *jit, torch_backend, python_backend):
        for name in ("owner_sum", "microbatch_mean", "ColumnarOwnerSum", "ColumnarMean"):
            assert hasattr(module, name), (module.__name__, name)


def test_engine_choice() -> None:
    """auto: CPU tensors NumPy can view, NumPy arrays and Arrow tables -> numba where installed (the same
    kernels through a zero-copy view); other tensors (another device, bfloat16) -> torch; anything else ->
    numpy; explicit names pass through (numpy stays pure NumPy); unknown names fail."""
    assert resolve_engine("auto", torch.zeros(1)) == ("numba" if JIT else "numpy")
    assert resolve_engine("auto", torch.zeros(1, dtype=torch.int32)) == ("numba" if JIT else "numpy")
    assert resolve_engine("auto", torch.zeros(1, dtype=torch.bfloat16)) == "torch"
    assert resolve_engine("auto", torch.zeros(1, device="meta")) == "torch"
    assert resolve_engine("auto", np.zeros(1)) == ("numba" if JIT else "numpy")
    assert resolve_engine("auto", pa.table({"x": [1.0]})) == ("numba" if JIT else "numpy")
    assert resolve_engine("auto", [1.0]) == "numpy"
    assert resolve_engine("numpy", np.zeros(1)) == "numpy"
    assert resolve_engine("python", torch.zeros(1)) == "python"
    assert set(available_engines()) == {"python", *NUMPY_LIKE, "torch"}
    with pytest.raises(GradaggError, match="engine must be one of auto, python, numpy, numba, torch; got 'cuda'"):
        owner_sum_columns([1], [0], [0], [1.0], engine="cuda")
    with pytest.raises(GradaggError, match="nonfinite must be 'propagate' or 'raise'"):
        owner_sum_columns([1], [0], [0], [1.0], nonfinite="ignore")


@pytest.mark.parametrize("engine", IMPLS)
def test_results_come_back_in_the_input_kind(engine: str) -> None:
    """NumPy in -> NumPy out and torch in -> torch out, whichever engine ran."""
    cols = (np.array([2, 1]), np.array([0, 0]), np.array([0, 0]), np.array([1.0, 2.0]))
    s, t = owner_sum_columns(*cols, engine=engine)
    assert isinstance(s, np.ndarray) and isinstance(t, np.ndarray) and s.tolist() == [1, 2]
    s, t = owner_sum_columns(*(torch.from_numpy(c) for c in cols), engine=engine)
    assert isinstance(s, torch.Tensor) and isinstance(t, torch.Tensor) and t.tolist() == [2.0, 1.0]
    means = microbatch_mean_columns(torch.ones(2, 3), engine=engine)
    assert isinstance(means, torch.Tensor) and means.tolist() == [1.0, 1.0, 1.0]


OWNER_ERRORS: list[tuple[tuple[Any, ...], type[Exception], str]] = [
    (([1, 2], [0, 0], [0], [1.0, 2.0]), RowShapeError, "shard_ids has 2, worker_ids has 2, owner_ids has 1, gradients"),
    (([1], [0], [0], np.zeros((1, 2, 2))), GradientShapeError, r"shape \(N,\) or \(N, D\), got shape \(1, 2, 2\)"),
    (([1], [0], [0], np.array([True])), GradientTypeError, "bool"),
    (([1], [0], [0], np.array(["1.0"])), GradientTypeError, "integers or floats"),
    (([1, "a"], [0, 0], [0, 0], [1.0, 2.0]), UnorderableShardError, r"shard ids 1 \(int\) and 'a' \(str\) both have"),
    (([1, None], [0, 0], [0, 0], [1.0, 2.0]), IdError, r"row 1: shard_ids is missing \(None\)"),
    ((np.array([1.5]), [0], [0], [1.0]), IdError, "shard_ids must hold int or str ids, got a float column"),
    (([1, 2], [0, 0], [0, 0], [[1.0], [1.0, 2.0]]), GradientShapeError, "differ in length"),
]


@pytest.mark.parametrize("columns, error, match", OWNER_ERRORS)
@pytest.mark.parametrize("engine", [*NUMPY_LIKE, "torch"])
def test_owner_sum_errors_name_where_and_what(
    engine: str, columns: tuple[Any, ...], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        owner_sum_columns(*columns, engine=engine)


def test_accumulator_rejects_a_batch_that_changes_kind() -> None:
    """Str ids (or ints beyond int64) after an integer table, and ints after str ids, are held as keys, so ints
    and strs can only fail to be ordered at the end (as in the reference, once both have owner rows); ints after
    a <U array are refused at once; vectors after scalars are a shape error."""
    acc = ColumnarOwnerSum()
    acc.update(np.array([1]), np.array([0]), np.array([0]), np.array([1.0]))
    acc.update(np.array(["a"]), np.array([0]), np.array([0]), np.array([1.0]))
    with pytest.raises(UnorderableShardError, match=r"shard ids 1 \(int\) and 'a' \(str\)"):
        acc.result()
    acc = ColumnarOwnerSum()
    acc.update(np.array([1]), np.array([0]), np.array([1]), np.array([1.0]))  # a replica: never counted
    acc.update(np.array(["a"]), np.array([0]), np.array([0]), np.array([1.0]))
    assert [x.tolist() for x in acc.result()] == [["a"], [1.0]]
    acc = ColumnarOwnerSum()
    acc.update(np.array(["a"]), np.array([0]), np.array([0]), np.array([1.0]))
    with pytest.raises(UnorderableShardError, match="row 1: shard ids are int in this batch but str .a <U array."):
        acc.update(np.array([1]), np.array([0]), np.array([0]), np.array([1.0]))
    with pytest.raises(IdError, match=r"row 1: the shard id 'b\\x00' ends in NUL"):
        acc.update(["b\x00"], [0], [0], [1.0])
    acc.update(["b"], [0], [0], [2.0])  # strings that <U holds exactly join the <U ids
    assert [x.tolist() for x in acc.result()] == [["a", "b"], [1.0, 2.0]]
    acc = ColumnarOwnerSum()
    acc.update(np.array(["a"], dtype=object), np.array([0]), np.array([0]), np.array([1.0]))
    acc.update(np.array([1]), np.array([0]), np.array([1]), np.array([1.0]))  # a replica: never counted
    assert [x.tolist() for x in acc.result()] == [["a"], [1.0]]
    acc.update(np.array([1]), np.array([0]), np.array([0]), np.array([1.0]))
    with pytest.raises(UnorderableShardError, match=r"shard ids 1 \(int\) and 'a' \(str\)"):
        acc.result()
    with pytest.raises(GradientShapeError, match="row 3: gradients are vectors of length 2, expected scalars"):
        acc.update(np.array(["b"], dtype=object), np.array([0]), np.array([0]), np.ones((1, 2)))


@pytest.mark.parametrize("engine", IMPLS)
def test_ids_of_different_kinds_compare_as_the_reference_compares_them(engine: str) -> None:
    """An int worker never equals a str owner (the row is a replica), as in the reference; no error."""
    rows = [[1, 0, "0", 1.0], [2, "w", "w", 2.0], [3, 2**64, 2**64, 4.0]]
    want = [[2, 2.0], [3, 4.0]]
    assert gradagg.owner_sum(rows) == want
    s, t = owner_sum_columns(*([r[k] for r in rows] for k in range(4)), engine=engine)
    assert [[a, b] for a, b in zip(s.tolist(), t.tolist())] == want


def owner_table() -> pa.Table:
    return pa.table(
        {
            "shard_id": pa.array(["x", "x", "y", "é", "x"]),
            "worker_id": pa.array([1, 2, 3, 4, 1], pa.int32()),
            "owner_id": pa.array([1, 1, 3, 4, 1], pa.int32()),
            "gradient": pa.array([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], pa.list_(pa.float32(), 2)),
        }
    )


def test_arrow_table_is_passed_alone_and_streamed_by_batch() -> None:
    """A table (one or many record batches, sliced or not) gives the same as its NumPy columns."""
    table = owner_table()
    s, t = owner_sum_columns(table)
    assert s.tolist() == ["x", "y", "é"] and t.tolist() == [[10.0, 12.0], [5.0, 6.0], [7.0, 8.0]]
    chunked = pa.Table.from_batches(table.to_batches(max_chunksize=2))
    assert [x.tolist() for x in owner_sum_columns(chunked)] == [s.tolist(), t.tolist()]
    s, t = owner_sum_columns(table.slice(1, 3))
    assert s.tolist() == ["y", "é"] and t.tolist() == [[5.0, 6.0], [7.0, 8.0]]


def test_arrow_errors() -> None:
    """Missing columns, extra columns passed alongside, and nulls are each named."""
    table = owner_table()
    with pytest.raises(FormatError, match=r"missing column\(s\) owner_id"):
        owner_sum_columns(table.drop_columns(["owner_id"]))
    with pytest.raises(GradaggError, match="pass an Arrow table alone"):
        owner_sum_columns(table, [1])
    nulls = table.set_column(1, "worker_id", pa.array([1, None, 3, 4, 1], pa.int32()))
    with pytest.raises(IdError, match=r"row 1: worker_id is null"):
        owner_sum_columns(nulls)


def test_arrow_microbatch_table_nulls_are_absent() -> None:
    """Columns are microbatches; a null is absent (zero, still counted in M = 2)."""
    table = pa.table({"m0": pa.array([2.0, None]), "m1": pa.array([4.0, 6.0])})
    assert microbatch_mean_columns(table).tolist() == [3.0, 3.0]


def test_gpu_script_skips_cleanly_without_cuda() -> None:
    """bench/gpu.py exits 0 with a stated reason where there is no CUDA device."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: run bench/gpu.py itself")
    done = subprocess.run([sys.executable, "bench/gpu.py"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "skip" in done.stdout.lower(), done.stdout + done.stderr


def test_benchmark_script_quick_smoke(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/bench_engines.py --quick runs a case end to end and prints the floor, engines and peers."""
    for peer in ("pandas", "polars", "duckdb"):
        pytest.importorskip(peer, reason="the peers come from requirements-bench.txt")
    spec = importlib.util.spec_from_file_location("bench_engines", ROOT / "bench" / "bench_engines.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_engines", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--repeat", "1", "--only", "str ids"]) == 0
    out = capsys.readouterr().out
    ours = ["gradagg numba (auto)"] if JIT else []
    ours.append("gradagg numpy (pure NumPy)")
    for name in ("memory-read floor", *ours, "pandas groupby", "Polars lazy", "DuckDB SQL"):
        assert name in out


@pytest.mark.parametrize("engine", IMPLS)
@pytest.mark.parametrize("gradients", [[2**63, 1], [2**64, -(2**64) + 3], [-(2**63) - 1, 0]])
def test_integers_beyond_int64_are_exact_or_refused(engine: str, gradients: list[int]) -> None:
    """The reference sums Python ints exactly (2**63 + 1 = 9223372036854775809): the python engine gives that
    int, the fixed-width engines refuse by name; never a rounded float."""
    want = reference.owner_sum([[1, 0, 0, g] for g in gradients])
    try:
        shards, totals = owner_sum_columns([1] * len(gradients), [0] * len(gradients), [0] * len(gradients),
                                           gradients, engine=engine)
    except GradaggError as exc:
        assert engine != "python" and "int64" in str(exc), str(exc)
        return
    got = [[s, t] for s, t in zip(shards.tolist(), totals.tolist())]
    assert got == want and all(type(t) is int for _, t in got), (got, want)


@pytest.mark.parametrize("engine", IMPLS)
@pytest.mark.parametrize("mask_shape", [(2, 2), (3, 3), (2, 4), (1, 3), (2,)])
def test_a_mask_of_another_shape_is_refused(engine: str, mask_shape: tuple[int, ...]) -> None:
    """values (2, 3) with a present mask of any other shape: every engine refuses, naming both shapes."""
    values = np.ones((2, 3))
    with pytest.raises(RowShapeError, match=r"present has shape .* values have shape \(2, 3\)"):
        microbatch_mean_columns(values, np.ones(mask_shape, dtype=bool), engine=engine)
    with pytest.raises(RowShapeError, match=r"present has shape"):
        microbatch_mean_columns(torch.ones(2, 3), torch.ones(mask_shape, dtype=torch.bool), engine=engine)


@pytest.mark.parametrize(("missing", "engine", "extra"), [("numpy", "numpy", "rows"), ("torch", "torch", "torch"),
                                                          ("numpy", "torch", "torch"), ("numba", "numba", "jit")])
def test_an_engine_whose_framework_is_missing_says_what_to_install(missing: str, engine: str, extra: str) -> None:
    """With the framework's import failing (None in sys.modules, as if not installed), asking for its engine is
    one GradaggError line naming the package and the install; "auto" falls back to the reference."""
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from gradagg.rows import engine\n"
        "from gradagg.errors import GradaggError\n"
        "print(engine.available_engines())\n"
        "print(engine.owner_sum_rows([[1, 0, 0, 2.0]]))\n"
        "for call in (lambda: engine.owner_sum_rows([[1, 0, 0, 2.0]], engine=E),\n"
        "             lambda: engine.microbatch_mean_columns([[1.0]], engine=E)):\n"
        "    try:\n"
        "        call()\n"
        "    except GradaggError as exc:\n"
        "        print(exc)\n"
    ).replace("E)", f"{engine!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert missing not in lines[0] and lines[1] == "[[1, 2.0]]", out
    want = (f"engine={engine!r} needs {missing}, which is not installed; install it with: pip install -e "
            f"'.[{extra}]' in a clone of gradagg (it is not on PyPI)")
    assert lines[2:] == [want, want], out


def test_the_python_engine_runs_without_numpy() -> None:
    """``engine="python"`` is the reference on columns: without NumPy its results are lists, as documented."""
    out = python(
        "import sys; sys.modules['numpy'] = None\n"
        "from gradagg.rows.engine import microbatch_mean_columns, owner_sum_columns\n"
        "print(owner_sum_columns(['x', 'x'], [0, 1], [0, 0], [1.5, 9.0], engine='python'))\n"
        "print(owner_sum_columns([], [], [], [], engine='python'))\n"
        "print(microbatch_mean_columns([[2, None], [4, 6]], engine='python'))"
    )
    assert out.splitlines() == ["(['x'], [1.5])", "([], [])", "[3.0, 3.0]"]
