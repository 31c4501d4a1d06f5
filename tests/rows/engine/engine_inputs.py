"""Shared pieces of the engine fuzz tests: generated inputs at the edges of their types, and exact comparison.

Every generated input is also given to :mod:`gradagg.reference`; an engine must
give the same answer, bit for bit (floats compared as bit patterns, so -0.0
and the last ulp count; a NaN is any NaN), or, where the input holds what that
engine says it cannot hold exactly, a clear :class:`~gradagg.errors.GradaggError`.
"""

from __future__ import annotations

import importlib.util
import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Derandomized: the same examples on every run and machine (a failure prints the example to rerun).
FUZZ = settings(derandomize=True, deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
# The numba engine (NumPy with fused kernels) wherever numba is installed: every engine test runs it too.
JIT: tuple[str, ...] = ("numba",) if importlib.util.find_spec("numba") else ()
NUMPY_LIKE = ("numpy", *JIT)
IMPLS = (*NUMPY_LIKE, "torch", "python")

INT_IDS = [0, 1, -1, 7, 2**31, 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1, -(2**63)]
STR_IDS = ["", "a", "a\x00", "\x00", "a\x00\x00", "b", "é", "\U0001f600", "\ud800", "x" * 300, "A", "a\x01"]
WORKERS_INT = [0, 1, 2, 2**63 - 1]
WORKERS_STR = ["w", "w\x00", "", "\U0001f600"]
FLOATS = [0.0, -0.0, 1.0, -2.5, 0.1, 5e-324, -5e-324, 2.2250738585072014e-308, 1e308, -1e308,
          math.inf, -math.inf, math.nan, 2.0**53, 2.0**53 + 2, 1e-300]
SMALL_INTS = [0, 1, -1, 3, 2**31, -(2**40), 2**40]


def floats() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True, width=64))


@st.composite
def owner_rows(draw: Any, *, vectors: bool = True) -> list[list[Any]]:
    """Rows of one id kind per column, gradients all ints, all floats or all vectors of one width."""
    shard_pool = draw(st.sampled_from([INT_IDS, STR_IDS]))
    worker_pool = draw(st.sampled_from([WORKERS_INT, WORKERS_STR]))
    kind = draw(st.sampled_from(["float", "int", "vector"] if vectors else ["float", "int"]))
    width = draw(st.integers(1, 3))
    values: st.SearchStrategy[Any] = floats() if kind != "int" else st.sampled_from(SMALL_INTS)
    gradient = st.lists(floats(), min_size=width, max_size=width) if kind == "vector" else values
    n = draw(st.integers(0, 30))
    return [
        [draw(st.sampled_from(shard_pool)), draw(st.sampled_from(worker_pool)), draw(st.sampled_from(worker_pool)),
         draw(gradient)]
        for _ in range(n)
    ]


@st.composite
def microbatch_rows(draw: Any) -> list[list[Any]]:
    """M microbatches of P values: all floats or all ints per draw, ``None`` = absent."""
    m, p = draw(st.integers(0, 6)), draw(st.integers(0, 5))
    values = floats() if draw(st.booleans()) else st.sampled_from(SMALL_INTS + [2**53 + 1, -(2**53) - 3])
    cell = st.one_of(st.none(), values)
    return [[draw(cell) for _ in range(p)] for _ in range(m)]


def bits(x: Any) -> Any:
    """A value in a form where equal means identical: floats by bit pattern, ints and strings as they are."""
    if isinstance(x, list):
        return [bits(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        # Which NaN's payload survives nan + nan is up to the hardware and the compiler's operand order
        # (IEEE 754 leaves it open), so a NaN is any NaN; every other float is compared bit for bit.
        return ("float", "nan")
    if isinstance(x, float):
        return ("float", struct.pack("<d", x))
    return (type(x).__name__, x)


def same_values(got: Any, want: Any) -> Any:
    """Bits of both, for an assert that shows both sides."""
    return bits(got), bits(want)


@contextmanager
def variant(impl: str) -> Iterator[str]:
    """The engine to pass as ``engine=`` (the only way a path is chosen)."""
    yield impl


MESSY = st.one_of(
    st.sampled_from([None, True, False, 1.5, "", "a\x00", [], [1, 2], {"a": 1}, b"x", (1,), [1, "x"], [None]]),
    st.integers(-(2**70), 2**70), st.sampled_from(INT_IDS + STR_IDS), floats(),
)


@st.composite
def messy_rows(draw: Any) -> list[Any]:
    """Mostly sound rows with a few bad fields: wrong types, None, bools, ragged or nested gradients, short rows."""
    rows = draw(owner_rows())
    for _ in range(draw(st.integers(0, 3))):
        if not rows:
            break
        r = draw(st.integers(0, len(rows) - 1))
        row = (list(rows[r]) if isinstance(rows[r], list) else []) + [0] * 4  # a short row padded back
        if draw(st.integers(0, 5)) == 0:
            rows[r] = row[: draw(st.integers(0, 3))] if draw(st.booleans()) else draw(MESSY)
            continue
        row[draw(st.integers(0, 3))] = draw(MESSY)
        rows[r] = row[:4]
    return rows
