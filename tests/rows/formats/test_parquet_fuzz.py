"""Generated Parquet files end in the reference's answer or a clear GradaggError, never a traceback.

Each file has a random schema (integer ids of every width, strings plain,
large or dictionary-encoded, the wrong types too; float16/32/64, integer and
list gradients), random nulls, one to several row groups, dictionary pages on
or off. The reference sees the file's own values (``Table.to_pylist``); the
stream (reader -> engine) must give its answer bit for bit, or a GradaggError
where the reference raises one too or where the engine names a limit of its
own (int64, 2**53, one vector length per batch); and the command line must
exit 0 with the reference's JSON or exit 2 with one line.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gradagg import reference  # noqa: E402  (after the importorskips)
from gradagg.errors import GradaggError  # noqa: E402
from gradagg.rows.engine import microbatch_mean_batches, owner_sum_batches  # noqa: E402
from gradagg.rows.formats import parquet  # noqa: E402
from tests.rows.engine.engine_inputs import bits  # noqa: E402  (tests/engines, on the pytest pythonpath)

FUZZ = settings(derandomize=True, deadline=None, max_examples=100,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ID_TYPES = {
    "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(), "uint8": pa.uint8(),
    "uint64": pa.uint64(), "string": pa.string(), "large_string": pa.large_string(),
    "dictionary": pa.dictionary(pa.int32(), pa.string()), "float64": pa.float64(), "bool": pa.bool_(),
}
INT_EDGES = {"int8": [-128, 0, 127], "int16": [-(2**15), 7, 2**15 - 1], "int32": [-(2**31), 1, 2**31 - 1],
             "int64": [-(2**63), 2**53 + 1, 2**63 - 1], "uint8": [0, 255], "uint64": [0, 2**63 - 1, 2**63, 2**64 - 1]}
STRINGS = ["", "a", "a\x00", "\x00", "é", "\U0001f600", "x" * 200]
FLOATS = [0.0, -0.0, 1.5, -2.0, 5e-324, 1e308, math.inf, -math.inf, math.nan, 0.1]
GRADIENT_TYPES = ["float64", "float32", "float16", "int64", "int32", "fixed3", "list", "bool", "string"]
# What the stream may refuse although the reference answers, always by name: a column type checked before any row
# is read (even in a file without rows), integers beyond int64 or 2**53, one vector length per batch.
ENGINE_LIMITS = ("has type", "int64", "2**53", "vector of length", "vectors of length")


def id_values(type_name: str) -> st.SearchStrategy[Any]:
    if type_name in INT_EDGES:
        return st.sampled_from(INT_EDGES[type_name])
    if type_name in ("string", "large_string", "dictionary"):
        return st.sampled_from(STRINGS)
    return st.sampled_from([1.5, -0.0]) if type_name == "float64" else st.booleans()


def gradient_values(type_name: str) -> st.SearchStrategy[Any]:
    if type_name in ("float64", "float32", "float16"):
        return st.sampled_from(FLOATS)
    if type_name in ("int64", "int32"):
        return st.sampled_from([0, -1, 3, 2**31 - 1, -(2**31)])
    if type_name == "fixed3":
        return st.lists(st.sampled_from(FLOATS), min_size=3, max_size=3)
    if type_name == "list":
        return st.lists(st.sampled_from(FLOATS), min_size=1, max_size=2)
    return st.booleans() if type_name == "bool" else st.sampled_from(["0.5", "x"])


def gradient_type(type_name: str) -> Any:
    named = {"float64": pa.float64(), "float32": pa.float32(), "float16": pa.float16(), "int64": pa.int64(),
             "int32": pa.int32(), "fixed3": pa.list_(pa.float64(), 3), "list": pa.list_(pa.float64()),
             "bool": pa.bool_(), "string": pa.string()}
    return named[type_name]


def column(values: list[Any], arrow_type: Any) -> Any:
    if pa.types.is_float16(arrow_type):  # pyarrow takes float16 only from NumPy
        mask = np.array([v is None for v in values], dtype=bool)
        with np.errstate(over="ignore"):  # 1e308 is inf in float16: a value like any other
            halves = np.array([0.0 if v is None else v for v in values], dtype=np.float16)
        return pa.array(halves, mask=mask)
    return pa.array(values, type=arrow_type)


@st.composite
def owner_files(draw: Any) -> tuple[Any, dict[str, Any]]:
    shard_t = draw(st.sampled_from(sorted(ID_TYPES)))
    worker_t = draw(st.sampled_from(sorted(ID_TYPES)))
    owner_t = worker_t if draw(st.integers(0, 4)) else draw(st.sampled_from(sorted(ID_TYPES)))
    grad_t = draw(st.sampled_from(GRADIENT_TYPES))
    n = draw(st.integers(0, 40))
    null_rate = draw(st.sampled_from([0.0, 0.0, 0.05]))
    types = [ID_TYPES[shard_t], ID_TYPES[worker_t], ID_TYPES[owner_t], gradient_type(grad_t)]
    strategies = [id_values(shard_t), id_values(worker_t), id_values(owner_t), gradient_values(grad_t)]
    cols = []
    for strategy, arrow_type in zip(strategies, types):
        values = [None if draw(st.floats(0, 1)) < null_rate else draw(strategy) for _ in range(n)]
        cols.append(column(values, arrow_type))
    table = pa.table(dict(zip(parquet.OWNER_COLUMNS, cols)))
    options = {"row_group_size": draw(st.sampled_from([None, 1, 7])), "use_dictionary": draw(st.booleans())}
    return table, options


@st.composite
def mean_files(draw: Any) -> tuple[Any, dict[str, Any]]:
    m, p = draw(st.integers(0, 4)), draw(st.integers(0, 30))
    kinds = draw(st.lists(st.sampled_from(["float64", "float32", "float16", "int64", "int32", "string"]),
                          min_size=m, max_size=m))
    cols = {}
    for i, kind in enumerate(kinds):
        values = [None if draw(st.integers(0, 5)) == 0 else draw(gradient_values(kind)) for _ in range(p)]
        cols[f"mb{i}"] = column(values, gradient_type(kind))
    options = {"row_group_size": draw(st.sampled_from([None, 3])), "use_dictionary": draw(st.booleans())}
    return pa.table(cols) if cols else pa.table({}), options


def outcome(fn: Any) -> Any:
    try:
        return bits(fn())
    except GradaggError as exc:
        return ("error", str(exc))


def is_error(x: Any) -> bool:
    return isinstance(x, tuple) and x[0] == "error"


def agrees(got: Any, want: Any) -> bool:
    """The same answer; or both refuse; or the engine names one of its own limits."""
    if got == want:
        return True
    if not is_error(got):
        return False
    return is_error(want) or any(limit in got[1] for limit in ENGINE_LIMITS)


def check_cli(cli: Any, contract: str, path: str, want: Any) -> None:
    status, out, err = cli(contract, path)
    if status == 0:
        assert err == "" and not is_error(want), (out, want)
        assert bits(json.loads(out)) == want, (out, want)  # JSON keeps -0.0, ints and every float's digits
    else:
        assert status == 2 and out == "" and err.startswith("gradagg: error: ") and err.count("\n") == 1, err


@FUZZ
@given(generated=owner_files())
def test_owner_sum_files(tmp_path_factory: Any, cli: Any, generated: tuple[Any, dict[str, Any]]) -> None:
    table, options = generated
    path = str(tmp_path_factory.mktemp("fuzz") / "rows.parquet")
    pq.write_table(table, path, **options)
    rows = [[r[c] for c in parquet.OWNER_COLUMNS] for r in pq.read_table(path).to_pylist()]
    want = outcome(lambda: reference.owner_sum(rows))
    got = outcome(lambda: [list(p) for p in zip(*(v.tolist() for v in owner_sum_batches(parquet.owner_batches(path))))])
    assert agrees(got, want), (got, want, table.schema)
    check_cli(cli, "owner-sum", path, got)


@FUZZ
@given(generated=mean_files())
def test_mean_files(tmp_path_factory: Any, cli: Any, generated: tuple[Any, dict[str, Any]]) -> None:
    table, options = generated
    path = str(tmp_path_factory.mktemp("fuzz") / "mean.parquet")
    pq.write_table(table, path, **options)
    read = pq.read_table(path)
    rows = [read.column(i).to_pylist() for i in range(read.num_columns)]  # column i is microbatch i
    want = outcome(lambda: reference.microbatch_mean(rows))
    got = outcome(lambda: microbatch_mean_batches(parquet.microbatch_batches(path)).tolist())
    mixed = is_error(got) and "must be all floats or all integers" in got[1]  # a format limit, named
    assert agrees(got, want) or mixed, (got, want, table.schema)
    check_cli(cli, "mean", path, got)
