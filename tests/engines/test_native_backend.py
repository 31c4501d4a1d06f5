"""gradagg.backends.native (the C owner-sum table) against the reference, and the engine's routing of buffers.

Generated buffer columns (ids at the int64 edges, sparse ids that force the hashed layout, dense ids
growing the table both ways; workers and owners plain or dictionary-encoded; float64, float32, int32,
int64 gradients with -0.0, NaN, infinities, subnormals) fed in one to three batches give the
reference's answer bit for bit (a NaN is any NaN), with nonfinite="raise" raising exactly the
reference's error. Integer totals are exact, and a total passing int64 is an error, never a wrapped
answer. Bad buffers are refused as GradaggErrors.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradagg import engine, reference
from gradagg.backends import native
from gradagg.errors import GradaggError, GradientTypeError, IdError, NonFiniteGradientError, RowShapeError
from tests.engines.engine_inputs import FLOATS, FUZZ, bits

if not native.available():
    pytest.skip("the native backend is not built (or GRADAGG_NATIVE=0)", allow_module_level=True)

EDGE_IDS = [0, 1, -1, 7, 1000, -(2**63), 2**63 - 1, 2**40, -(2**31), 2**31 - 1]
WIDE = {"q": (-(2**63), 2**63 - 1), "i": (-(2**31), 2**31 - 1)}


class Dictionary:
    """A dictionary-encoded buffer column, as the native Parquet reader yields."""

    def __init__(self, values: list[int], fmt: str) -> None:
        distinct = sorted(set(values), key=values.index)
        self.values = memoryview(array(fmt, distinct))
        self.indices = memoryview(array("I", [distinct.index(v) for v in values]))


def column(values: list[Any], fmt: str, dictionary: bool) -> Any:
    return Dictionary(values, fmt) if dictionary and fmt in "iq" else memoryview(array(fmt, values))


@st.composite
def buffer_rows(draw: Any) -> tuple[list[list[Any]], str, str, str, list[int], list[bool]]:
    shard_fmt, id_fmt = draw(st.sampled_from("qi")), draw(st.sampled_from("qi"))
    grad_fmt = draw(st.sampled_from("dfqi"))
    lo, hi = WIDE[shard_fmt]
    shard = st.one_of(st.sampled_from([v for v in EDGE_IDS if lo <= v <= hi]), st.integers(-40, 40),
                      st.integers(lo, hi))  # (the last: sparse ids, the hashed layout)
    worker = st.sampled_from([0, 1, 2, WIDE[id_fmt][1]])
    if grad_fmt in "df":
        grad: st.SearchStrategy[Any] = st.sampled_from(FLOATS if grad_fmt == "d" else [0.0, -0.0, 1.5, float("nan"),
                                                                                     float("inf"), 2.0**-149])
    else:
        grad = st.sampled_from([0, -1, 3, 2**31 - 1, -(2**31)] + ([2**40, -(2**60)] if grad_fmt == "q" else []))
    n = draw(st.integers(0, 60))
    rows = [[draw(shard), draw(worker), draw(worker), draw(grad)] for _ in range(n)]
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=2)))
    encodings = [draw(st.booleans()) for _ in range(3)]
    return rows, shard_fmt, id_fmt, grad_fmt, cuts, encodings


def feed(rows: list[list[Any]], fmts: tuple[str, str, str], cuts: list[int], encodings: list[bool],
         nonfinite: str = "propagate") -> list[list[Any]]:
    """The rows fed to the native accumulator in batches cut at ``cuts``; the result as the reference's pairs."""
    acc = native.OwnerSumAccumulator(nonfinite=nonfinite)
    bounds = [0, *cuts, len(rows)]
    for a, b in zip(bounds, bounds[1:]):
        part = rows[a:b]
        columns = [column([r[k] for r in part], fmts[min(k, 1)], encodings[k]) for k in range(3)]
        acc.update(*columns, memoryview(array(fmts[2], [r[3] for r in part])))
    shards, totals = acc.result()
    return [[s, t] for s, t in zip(shards.tolist(), totals.tolist())]


def as_reference_sees(rows: list[list[Any]], grad_fmt: str) -> list[list[Any]]:
    """float32 gradients as the float32 values they are (what a float32 buffer holds)."""
    if grad_fmt != "f":
        return rows
    return [[*r[:3], array("f", [r[3]])[0]] for r in rows]


def outcome(fn: Any) -> Any:
    try:
        return bits(fn())
    except GradaggError as exc:
        return ("error", type(exc).__name__, str(exc))


@FUZZ
@given(buffer_rows(), st.sampled_from(["propagate", "raise"]))
def test_native_equals_the_reference(generated: Any, nonfinite: str) -> None:
    """Same totals bit for bit (row order, from -0.0), or the reference's own NonFiniteGradientError message."""
    rows, shard_fmt, id_fmt, grad_fmt, cuts, encodings = generated
    seen = as_reference_sees(rows, grad_fmt)
    want = outcome(lambda: reference.owner_sum(seen, nonfinite=nonfinite))
    got = outcome(lambda: feed(seen, (shard_fmt, id_fmt, grad_fmt), cuts, encodings, nonfinite))
    assert got == want, (got, want)


def test_layouts_dense_growing_both_ways_then_hashed() -> None:
    """Ids 500, then 10 (grows left), 5000 (grows right), then 2**40 and -2**63 (hashed): every total kept."""
    rows = [[500, 0, 0, 1.0], [10, 0, 0, 2.0], [5000, 1, 1, 4.0], [500, 0, 0, 8.0], [2**40, 0, 0, 16.0],
            [-(2**63), 0, 0, -0.0], [10, 0, 0, 32.0], [2**63 - 1, 1, 0, 99.0], [2**63 - 1, 0, 0, 64.0]]
    for cuts in ([], [1], [2, 5], [4, 6]):
        assert bits(feed(rows, ("q", "q", "d"), cuts, [False] * 3)) == bits(reference.owner_sum(rows))


def test_integer_totals_are_exact_and_an_overflow_is_an_error() -> None:
    """2**62 + 2**62 - 1 + ... stays exact up to 2**63 - 1; one more row passes int64 and is refused by row."""
    rows = [[1, 0, 0, 2**62], [1, 0, 0, 2**62 - 1], [2, 0, 0, -(2**63)]]
    assert feed(rows, ("q", "q", "q"), [], [False] * 3) == [[1, 2**63 - 1], [2, -(2**63)]]
    with pytest.raises(GradaggError, match=r"row 3: gradient of shard 1: its integer total 9223372036854775807 \+ 1 "
                                           r"passes int64; use engine='python'"):
        feed([*rows, [1, 0, 0, 1]], ("q", "q", "q"), [2], [False] * 3)


def test_bad_buffers_are_refused() -> None:
    """Wrong formats, 2-D views, columns of several lengths, indices past the dictionary: GradaggErrors."""
    ids, grads = memoryview(array("q", [1, 2])), memoryview(array("d", [1.0, 2.0]))
    acc = native.OwnerSumAccumulator()
    with pytest.raises(IdError, match="format 'B'"):
        acc.update(memoryview(b"\x01\x02"), ids, ids, grads)
    with pytest.raises(GradientTypeError, match="format 'b'"):
        acc.update(ids, ids, ids, memoryview(array("b", [1, 2])))
    with pytest.raises(IdError, match="2 dimensions"):
        acc.update(memoryview(array("q", [1, 2, 3, 4])).cast("B").cast("q", (2, 2)), ids, ids, grads)
    with pytest.raises(RowShapeError, match="owner_ids has 1"):
        acc.update(ids, ids, memoryview(array("q", [1])), grads)
    with pytest.raises(GradientTypeError, match="integers here but float totals"):
        acc.update(ids, ids, ids, grads)
        acc.update(ids, ids, ids, memoryview(array("q", [1, 2])))
    broken = Dictionary([1, 2], "q")
    broken.indices = memoryview(array("I", [0, 2]))
    fresh = native.OwnerSumAccumulator()
    with pytest.raises(IdError, match="row 1: index 2 into a dictionary of 2 values"):
        fresh.update(broken, ids, ids, grads)
    with pytest.raises(GradaggError, match="stopped part-way"):
        fresh.result()


def test_a_nonfinite_stop_leaves_the_accumulator_unusable() -> None:
    """After a raise mid-batch the totals hold part of a batch: result() refuses instead of returning them."""
    acc = native.OwnerSumAccumulator(nonfinite="raise")
    ids = memoryview(array("q", [1, 1]))
    with pytest.raises(NonFiniteGradientError, match="row 1: gradient of shard 1 is nan"):
        acc.update(ids, ids, ids, memoryview(array("d", [1.0, float("nan")])))
    with pytest.raises(GradaggError, match="stopped part-way"):
        acc.update(ids, ids, ids, memoryview(array("d", [1.0, 2.0])))


@pytest.mark.parametrize("name", ["auto", "numpy", "python", "torch"])
def test_the_engine_routes_buffers(name: str) -> None:
    """auto: buffers go to the native backend (array results); numpy, python, torch: converted, the same answer."""
    if name == "torch":
        pytest.importorskip("torch")
    columns = (Dictionary([3, 3, 1, 2], "q"), memoryview(array("i", [0, 1, 2, 4])), Dictionary([0, 0, 2, 4], "i"),
               memoryview(array("d", [1.0, 9.0, 2.0, -0.0])))
    acc = engine.OwnerSumAccumulator(engine=name)
    acc.update(*columns)
    shards, totals = acc.result()
    assert acc.engine == ("native" if name == "auto" else name)
    assert bits([engine.python_values(shards), engine.python_values(totals)]) == bits([[1, 2, 3], [2.0, -0.0, 1.0]])
    if name == "auto":
        assert isinstance(shards, array) and isinstance(totals, array)
