"""Wide and narrow dtypes on every engine against the reference: uint64 past int64, the int extremes, half floats.

Issue 22: the torch engine turned uint64 gradients 2**64 - 1 and 1 into the total 0 (a wrap to int64), exit 0,
and a torch.uint64 shard id 2**64 - 1 into shard -1. Each case here runs on every engine, on NumPy arrays and on
torch tensors of each dtype: the answer is the reference's bit for bit (on the columns' Python values), or, for
integer gradients whose counted magnitudes reach 2**62, a GradaggError naming int64 (the fixed-width engines'
documented limit; the python engine sums them exactly). Ids are exact keys on every engine: never refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from gradagg import reference
from gradagg.errors import GradaggError
from gradagg.rows.engine import microbatch_mean_columns, owner_sum_columns, python_values
from tests.rows.engine.engine_inputs import IMPLS, bits

ENGINES = (*IMPLS, "auto")
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
TORCH_ONLY = ["bfloat16"]
LIMIT = 2**62  # below this the counted magnitudes never trip the int64 headroom check (its bound is 2**63)


def extremes(dtype: str) -> list[Any]:
    """The dtype's min, max and values next to them, as Python numbers the dtype holds exactly."""
    if dtype in INT_DTYPES:
        info = np.iinfo(dtype)
        return [int(info.max), 1, int(info.min), int(info.max) - 1, 0, int(info.max)]
    if dtype == "bfloat16":
        big = float(torch.finfo(torch.bfloat16).max)
        return [big, 1.0, -big, 2.0**-133, -0.0, 0.5]
    info64 = np.finfo(dtype)
    return [float(info64.max), 1.0, float(info64.min), float(info64.smallest_subnormal), -0.0, 0.5]


def column(values: list[Any], dtype: str, kind: str) -> Any:
    """``values`` as a NumPy array or a torch tensor of ``dtype``."""
    if kind == "torch":
        return torch.tensor(values, dtype=getattr(torch, dtype))
    return np.array(values, dtype=dtype)


def cases() -> list[tuple[str, str]]:
    numpy_side = [(d, "numpy") for d in INT_DTYPES + FLOAT_DTYPES]
    return numpy_side + [(d, "torch") for d in INT_DTYPES + FLOAT_DTYPES + TORCH_ONLY]


def refusal_allowed(counted: list[Any], exc: GradaggError) -> bool:
    """Integer gradients only, counted magnitudes at 2**62 or more, and the message names int64."""
    ints = all(isinstance(v, int) for v in counted)
    return ints and sum(abs(v) for v in counted) >= LIMIT and "int64" in str(exc)


def outcome(fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return bits([python_values(x) for x in fn(*args, **kw)]) if fn is owner_sum_columns else \
            bits(python_values(fn(*args, **kw)))
    except GradaggError as exc:
        return exc


@pytest.mark.parametrize(("dtype", "kind"), cases())
@pytest.mark.parametrize("engine", ENGINES)
def test_gradients_of_every_dtype(engine: str, dtype: str, kind: str) -> None:
    """Gradients at the dtype's extremes: the reference's totals, or a refusal naming int64 past its range."""
    values = extremes(dtype)
    shards, workers, owners = [1, 2, 1, 2, 1, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0]
    rows = [[s, w, o, g] for s, w, o, g in zip(shards, workers, owners, values)]
    want = bits([list(c) for c in zip(*reference.owner_sum(rows))])
    counted = [g for s, w, o, g in rows if w == o]
    got = outcome(owner_sum_columns, np.array(shards), np.array(workers), np.array(owners),
                  column(values, dtype, kind), engine=engine)
    if isinstance(got, GradaggError):
        assert refusal_allowed(counted, got), (engine, dtype, kind, str(got))
    else:
        assert got == want, (engine, dtype, kind)


@pytest.mark.parametrize(("dtype", "kind"), [c for c in cases() if c[0] in INT_DTYPES])
@pytest.mark.parametrize("engine", ENGINES)
def test_ids_of_every_integer_dtype(engine: str, dtype: str, kind: str) -> None:
    """Shard, worker and owner ids at the dtype's extremes are exact keys on every engine: never wrapped."""
    ids = extremes(dtype)
    workers = [ids[0], ids[2], ids[1], ids[3], ids[4], ids[5]]
    owners = [ids[0], ids[2], ids[2], ids[3], ids[4], ids[1]]
    grads = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    rows = [[s, w, o, g] for s, w, o, g in zip(ids, workers, owners, grads)]
    want = bits([list(c) for c in zip(*reference.owner_sum(rows))])
    cols = (column(ids, dtype, kind), column(workers, dtype, kind), column(owners, dtype, kind), np.array(grads))
    got = outcome(owner_sum_columns, *cols, engine=engine)
    assert got == want, (engine, dtype, kind, got)


@pytest.mark.parametrize(("dtype", "kind"), cases())
@pytest.mark.parametrize("engine", ENGINES)
def test_mean_values_of_every_dtype(engine: str, dtype: str, kind: str) -> None:
    """Microbatch values at the dtype's extremes (some absent): the reference's means, or a refusal naming int64."""
    flat = extremes(dtype)
    values = [flat[:3], flat[3:]]
    present = [[True, False, True], [True, True, True]]
    rows = [[v if p else None for v, p in zip(vr, pr)] for vr, pr in zip(values, present)]
    want = bits(reference.microbatch_mean(rows))
    got = outcome(microbatch_mean_columns, column(values, dtype, kind),
                  torch.tensor(present) if kind == "torch" else np.array(present), engine=engine)
    counted = [v for vr, pr in zip(values, present) for v, p in zip(vr, pr) if p]
    if isinstance(got, GradaggError):
        assert refusal_allowed(counted, got), (engine, dtype, kind, str(got))
    else:
        assert got == want, (engine, dtype, kind)


@pytest.mark.parametrize("engine", ["torch", "auto"])
def test_torch_uint64_shard_id_past_int64_is_not_shard_minus_one(engine: str) -> None:
    """Issue 22: a torch.uint64 shard id 2**64 - 1 became shard -1 on the torch engine."""
    shards, totals = owner_sum_columns(torch.tensor([2**64 - 1], dtype=torch.uint64), torch.tensor([0]),
                                       torch.tensor([0]), torch.tensor([1.0]), engine=engine)
    assert python_values(shards) == [2**64 - 1] and python_values(totals) == [1.0]


@pytest.mark.parametrize("engine", ["torch", "auto"])
@pytest.mark.parametrize("gradients", [[2**64 - 1, 1], [2**64 - 1]])
def test_torch_uint64_gradients_past_int64_are_refused(engine: str, gradients: list[int]) -> None:
    """Issue 22: [2**64 - 1, 1] summed to 0 and [2**64 - 1] to -1 on the torch engine; numpy refuses, so must it."""
    n = len(gradients)
    for grads in (np.array(gradients, dtype=np.uint64), torch.tensor(gradients, dtype=torch.uint64)):
        with pytest.raises(GradaggError, match="beyond int64"):
            owner_sum_columns(np.full(n, 7), np.zeros(n, np.int64), np.zeros(n, np.int64), grads, engine=engine)
