"""Ownership and owner_reduce in one process, the mismatch message, the buffer layout, and the import boundary."""

from __future__ import annotations

import subprocess
import sys

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from gradagg.errors import CollectiveError, GradientShapeError, GradientTypeError, IdError
from gradagg.reference import owner_sum
from gradagg.torch import Ownership, ShardSpec, count_collectives, owner_reduce
from gradagg.torch.collectives import _mismatch_message
from gradagg.torch.reduce import _Layout


def test_owner_reduce_one_process_matches_reference() -> None:
    """Rank 0 owns x and y: x = 1 + 2 (an owner's contributions add), y = 5; z declared but not passed: absent."""
    own = Ownership.from_tensors({s: torch.zeros(1) for s in "xyz"}, owners=0)
    pairs = [("x", torch.tensor([1.0])), ("y", torch.tensor([5.0])), ("x", torch.tensor([2.0]))]
    with count_collectives() as c:
        got = owner_reduce(pairs, own)
    rows = [[s, 0, 0, float(t)] for s, t in pairs]
    assert [[s, float(t)] for s, t in got.items()] == owner_sum(rows)
    assert c.total == 0


def test_contribution_errors() -> None:
    """An undeclared shard or a wrong shape is named with both values."""
    own = Ownership({"w": ShardSpec((2,), torch.float32, 0)})
    with pytest.raises(IdError, match="'v'"):
        owner_reduce({"v": torch.zeros(2)}, own)
    with pytest.raises(GradientShapeError, match=r"shape=\(3,\).*declared \(shape=\(2,\)"):
        owner_reduce({"w": torch.zeros(3)}, own)


def test_declaration_errors() -> None:
    """Bad shard ids and owners are refused when declared; missing owners when built from tensors."""
    with pytest.raises(IdError):
        Ownership({1.5: ShardSpec((1,), torch.float32, 0)})  # type: ignore[dict-item]
    with pytest.raises(IdError, match="non-negative"):
        Ownership({"w": ShardSpec((1,), torch.float32, -1)})
    with pytest.raises(IdError, match="no owner"):
        Ownership.from_tensors({"w": torch.zeros(1)}, owners={"v": 0})
    with pytest.raises(CollectiveError, match="owner rank 2"):
        Ownership.from_tensors({"w": torch.zeros(1)}, owners=2).verify()


def test_canonical_order_mixed_ids() -> None:
    """Ints before strings, then by value: the same layout whatever order each rank declared in."""
    a = Ownership.from_tensors({"b": torch.zeros(1), 2: torch.zeros(1), "a": torch.zeros(1)}, owners=0)
    assert list(a) == [2, "a", "b"]


def test_mismatch_message_names_ranks_and_values() -> None:
    """Rank 1 declares w with shape (2,): the message names ranks 0 and 1 and both declarations."""
    t0: list[tuple[object, str]] = [("w", "(shape=(3,), dtype=float32, owner=0)")]
    t1: list[tuple[object, str]] = [("w", "(shape=(2,), dtype=float32, owner=0)"), ("v", "(shape=(1,))")]
    msg = _mismatch_message([t0, t1], "ownership declarations")
    assert "rank 0 declared 'w' as (shape=(3,), dtype=float32, owner=0)" in msg
    assert "rank 1 declared (shape=(2,), dtype=float32, owner=0)" in msg
    assert "rank 0 declared 'v' as nothing, but rank 1 declared (shape=(1,))" in msg


def test_collective_choice_by_bytes() -> None:
    """2 ranks owning half each: the gather sends half what a ring all_reduce sends; one owner: all_reduce."""
    balanced = Ownership({i: ShardSpec((100,), torch.float32, i % 2) for i in range(4)})
    skewed = Ownership({i: ShardSpec((100,), torch.float32, 0) for i in range(4)})
    assert _Layout(balanced, 2).gather_moves_fewer_bytes()
    assert not _Layout(skewed, 4).gather_moves_fewer_bytes()


def test_import_gradagg_does_not_import_torch() -> None:
    """``import gradagg`` stays light: torch is loaded only by ``import gradagg.torch``."""
    code = "import sys, gradagg; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "ok", out.stderr


def test_from_module_in_one_process() -> None:
    """No process group: every parameter is one shard owned by rank 0, tied ones under each name, with their
    shapes and dtypes; owner_reduce then accepts named_parameters-keyed gradients."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2, bias=False).double())
    model.append(model[0])  # tied: the same module (and parameters) under a second name
    own = Ownership.from_module(model)
    assert list(own) == ["0.bias", "0.weight", "1.weight", "2.bias", "2.weight"]
    assert own.spec("1.weight") == ShardSpec((2, 3), torch.float64, 0) and own.owned_by(0) == list(own)
    got = owner_reduce({n: torch.ones(p.shape, dtype=p.dtype) for n, p in model.named_parameters()}, own)
    assert list(got) == ["0.bias", "0.weight", "1.weight"]  # named_parameters() lists each tensor once


def test_shape_forms_declare_one_shape() -> None:
    """A list, a torch.Size and a tuple are one shape: owner_reduce accepts a (2,) gradient for each form."""
    forms = [ShardSpec([2], torch.float32, 0), ShardSpec(torch.Size([2]), torch.float32, 0)]  # type: ignore[arg-type]
    for spec in forms:
        assert spec == ShardSpec((2,), torch.float32, 0) and spec.describe() == "(shape=(2,), dtype=float32, owner=0)"
        assert owner_reduce({"w": torch.ones(2)}, Ownership({"w": spec}))["w"].tolist() == [1.0, 1.0]


def test_bad_shapes_and_dtypes_refused() -> None:
    """A negative or non-int dimension, or a dtype that is not a torch.dtype, is an IdError naming the shard."""
    with pytest.raises(IdError, match=r"shard 'w': shape must be a tuple of non-negative ints, got \(2, -1\)"):
        Ownership({"w": ShardSpec((2, -1), torch.float32, 0)})
    with pytest.raises(IdError, match="shard 'w': shape"):
        Ownership({"w": ShardSpec((2.0,), torch.float32, 0)})  # type: ignore[arg-type]
    with pytest.raises(IdError, match="shard 'w': dtype must be a torch.dtype, got str 'float32'"):
        Ownership({"w": ShardSpec((2,), "float32", 0)})  # type: ignore[arg-type]


def test_contribution_that_is_not_a_tensor() -> None:
    """A float where a gradient tensor belongs: GradientTypeError naming the shard, not an AttributeError."""
    own = Ownership({"w": ShardSpec((1,), torch.float32, 0)})
    with pytest.raises(GradientTypeError, match="shard 'w' is float; expected a tensor"):
        owner_reduce({"w": 1.0}, own)  # type: ignore[dict-item]


_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]  # fmt: skip


@st.composite
def _declarations(draw: st.DrawFn) -> tuple[int, dict[str, torch.Tensor], Ownership, list[dict[str, torch.Tensor]]]:
    """W ranks; shards of any dtype and small shape (empty ones too) with arbitrary bit patterns (NaN payloads,
    -0.0, subnormals, int extremes); each rank's contributions: owned shards (some left out), stale garbage
    for the others."""
    world = draw(st.integers(1, 4))
    values: dict[str, torch.Tensor] = {}
    owners: dict[str, int] = {}
    for i in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        values[f"s{i}"] = _tensor_of(draw, dtype, shape)
        owners[f"s{i}"] = draw(st.integers(0, world - 1))
    own = Ownership.from_tensors(values, owners)
    per_rank = []
    for rank in range(world):
        local = {}
        for s, t in values.items():
            if owners[s] != rank:
                local[s] = _tensor_of(draw, t.dtype, tuple(t.shape))  # a stale replica: never read
            elif draw(st.booleans()) or s == "s0":
                local[s] = t
        per_rank.append(local)
    return world, values, own, per_rank


def _special_bits(dtype: torch.dtype) -> list[bytes]:
    """Bit patterns where a buffer that is not exact shows: -0.0, a signalling NaN, int64's minimum (the bits
    of float64 -0.0), values beyond 2**24 and 2**53, the extremes, the smallest subnormal."""
    if dtype.is_floating_point or dtype.is_complex:
        real = {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)
        values = [-0.0, float("inf"), float("-inf"), torch.finfo(real).max, torch.finfo(real).smallest_normal / 4]
        out = [bytes(torch.tensor([v], dtype=dtype).view(torch.uint8).tolist()) for v in values]
        if real == torch.float64:
            signalling = (0x7FF0_0000_0000_0001).to_bytes(8, "little")
            out += [signalling * (dtype.itemsize // 8)]
        return out
    info = torch.iinfo(dtype)
    values = [info.min, info.max, -1] + ([2**24 + 1, 2**53 + 1, -(2**53) - 1] if dtype == torch.int64 else [])
    return [bytes(torch.tensor([v], dtype=dtype).view(torch.uint8).tolist()) for v in values if info.min <= v]


def _tensor_of(draw: st.DrawFn, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool).reshape(shape)
    k = dtype.itemsize
    element = st.one_of(st.sampled_from(_special_bits(dtype)), st.binary(min_size=k, max_size=k))
    raw = b"".join(draw(st.lists(element, min_size=n, max_size=n)))
    return torch.frombuffer(bytearray(raw) or bytearray(1), dtype=torch.uint8)[: len(raw)].view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


@settings(max_examples=60, deadline=None)
@given(case=_declarations(), collective=st.sampled_from(["all_reduce", "all_gather"]))
def test_layout_carries_every_dtype_bit_exactly(case: tuple, collective: str) -> None:  # type: ignore[type-arg]
    """Every rank packs its buffer, the ranks' buffers are summed as int64 lanes (an all_reduce) or concatenated
    (an all_gather), and unpacking gives back each contributed shard with the owner's bytes, declared dtype and
    shape, whatever the dtypes mixed in one declaration; a shard its owner left out is absent."""
    world, values, own, per_rank = case
    layout = _Layout(own, world)
    if collective == "all_reduce":
        total = sum(layout.pack_all_reduce(local, False, r).clone() for r, local in enumerate(per_rank))
        got, bad = layout.unpack_all_reduce(total)
    else:
        got, bad = layout.unpack_all_gather(
            torch.cat([layout.pack_all_gather(local, False, r).clone() for r, local in enumerate(per_rank)])
        )
    contributed = [s for s in values if s in per_rank[own.owner(s)]]
    assert list(got) == contributed and bad == []
    for s in contributed:
        assert got[s].dtype == values[s].dtype and got[s].shape == values[s].shape
        assert _bits(got[s]) == _bits(values[s]), s


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_layout_reports_the_bad_rank(collective: str) -> None:
    """Rank 2 of 3 reports an error: its data is not sent, and every rank reads back [2] as the bad ranks."""
    own = Ownership({"a": ShardSpec((2,), torch.int64, 2), "b": ShardSpec((1,), torch.float32, 0)})
    layout = _Layout(own, 3)
    local = [{"b": torch.ones(1)}, {}, {"a": torch.tensor([5, 6])}]
    if collective == "all_reduce":
        got, bad = layout.unpack_all_reduce(
            sum(layout.pack_all_reduce(x, r == 2, r).clone() for r, x in enumerate(local))
        )
    else:
        got, bad = layout.unpack_all_gather(
            torch.cat([layout.pack_all_gather(x, r == 2, r).clone() for r, x in enumerate(local)])
        )
    assert bad == [2] and list(got) == ["b"]


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (lambda: Ownership.from_tensors([torch.zeros(2)], owners=[0]), "tensors"),
        (lambda: Ownership.from_tensors((torch.zeros(2),), owners=0), "tensors"),
        (lambda: Ownership.from_tensors({0: torch.zeros(2)}, owners=[0]), "owners"),
        (lambda: Ownership.from_tensors({0: torch.zeros(2)}, owners="0"), "owners"),
        (lambda: Ownership([ShardSpec((2,), torch.float32, 0)]), "shards"),
        (lambda: Ownership({0: (2,)}), "shard 0"),
        (lambda: Ownership.from_tensors({0: [1.0, 2.0]}, owners=0), "shard 0"),
    ],
)
def test_declarations_of_the_wrong_kind_are_named(build: object, names: str) -> None:
    """A list where a mapping is expected (or a non-tensor, non-spec value) is an IdError naming the argument
    and what it got, never a raw AttributeError from inside the declaration."""
    with pytest.raises(IdError, match=names) as info:
        build()  # type: ignore[operator]
    assert "expected" in str(info.value)
