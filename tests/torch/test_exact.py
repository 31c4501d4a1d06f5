"""owner_reduce and grad_norm across 2 gloo ranks: exact whatever the dtypes, the same on every rank.

One world runs both checks (worker functions in ``tests.torch.workers.exact``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import exact as w

# The options of every world in this test process: the fork server starts once, with the first world's.
WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}


@pytest.fixture(scope="module")
def reduced() -> list[dict[str, Any]]:
    return run_local_world(w.owner_reduce_exact_world, 2, **WORLD)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_owner_reduce_carries_every_dtype_bit_exactly(reduced: list[dict[str, Any]], collective: str) -> None:
    """int64 2**40 + 1 and 2**53 + 1 come back as themselves (a float32 buffer returned 2**40), next to float32,
    float64 (NaN payload, -0.0, the smallest subnormal), float16, bfloat16, complex64, bool, int8 and an empty
    shard, all in one declaration: every byte equal to the owner's, declared dtype and shape, one collective."""
    op = "all_gather" if collective == "all_gather" else "all_reduce(sum)"
    for r in reduced:
        got = r[collective]
        for name, t in w.exact_values().items():
            assert got["bytes"][name] == w.as_bytes(t), name
            assert got["dtypes"][name] == str(t.dtype) and got["shapes"][name] == tuple(t.shape), name
        assert got["collectives"] == {op: 1}


def test_int64_next_to_float32_is_not_rounded(reduced: list[dict[str, Any]]) -> None:
    """The issue's case: int64 shard i = 2**40 + 1 (owner rank 0) beside float32 w = 1.5 (owner rank 1) comes back
    as 2**40 + 1 on both ranks (through a float32 buffer it came back as 2**40)."""
    for r in reduced:
        assert r["issue"] == {"i": [2**40 + 1], "w": [1.5]}


@pytest.fixture(scope="module")
def norms() -> list[dict[str, Any]]:
    return run_local_world(w.norm_dtype_world, 2, **WORLD)


def test_grad_norm_same_dtype_and_bits_on_every_rank(norms: list[dict[str, Any]]) -> None:
    """Rank 0's gradients are float32, rank 1's float64: both ranks return float64 (a float64 gradient exists on
    some rank) with the same bits, undeclared, declared and when clipping; one all_reduce for the clip."""
    for key in ("plain", "declared", "clipped"):
        assert norms[0][key] == norms[1][key], key
        assert norms[0][key][0] == "torch.float64", key
    for r in norms:
        assert r["collectives"] == {"all_reduce(sum)": 1}


def test_grad_norm_values(norms: list[dict[str, Any]]) -> None:
    """rep = (0.1, 0.2, 0.3) counted once (rank 0): |rep|^2 = 0.14. Declared: + e0 = (1/3, 2/7), e1 = 2 * e0:
    0.14 + 5 * (1/9 + 4/49). Rank 0's values are float32, hence the tolerance (float32 rounding, ~6e-8)."""
    plain = float.fromhex(norms[0]["plain"][1])
    declared = float.fromhex(norms[0]["declared"][1])
    assert plain == pytest.approx(math.sqrt(0.14), rel=1e-6)
    assert declared == pytest.approx(math.sqrt(0.14 + 5 * (1 / 9 + 4 / 49)), rel=1e-6)
