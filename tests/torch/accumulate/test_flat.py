"""The flat buffer's layout: every gradient lands where its collective and its reader expect it (property tests)."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from gradagg.torch.accumulate.flat import FlatLayout, ParamSpec

SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.complex64])


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(SHAPES, DTYPES, st.booleans()), min_size=1, max_size=6),
    ways=st.integers(1, 4),
    cap=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_every_gradient_reads_back_from_its_slot(
    specs: list[tuple[tuple[int, ...], torch.dtype, bool]], ways: int, cap: int, seed: int
) -> None:
    """For any shapes (0-d, empty, rows fewer than shard ranks), dtypes, shard counts and bucket caps: a gradient
    added to its slot reads back whole (all_reduce kind), and shard rank r reads exactly ``torch.chunk``'s rows r
    of it from its reduce-scatter segment (empty when chunk gives fewer than ``ways`` pieces). Buckets do not
    overlap and the counters sit in the last one."""
    g = torch.Generator().manual_seed(seed)
    param_specs = [ParamSpec(s, d, "reduce_scatter" if rs else "all_reduce") for s, d, rs in specs]
    grads = [torch.randn(s, dtype=d, generator=g) for s, d, _ in specs]
    for r in range(ways):
        layout = FlatLayout(
            param_specs, world=ways, rank=r, device=torch.device("cpu"), bucket_elems=cap, ways=ways, shard_rank=r
        )
        flat = torch.zeros(layout.size, dtype=layout.dtype)
        for i, grad in enumerate(grads):
            layout.add(flat, i, grad)
        out = torch.zeros(max(layout.out_size, 1), dtype=layout.dtype)
        for b, bk in enumerate(layout.buckets):
            if bk.kind == "reduce_scatter":
                out[bk.out : bk.out + bk.seg] = layout.segments(flat, b)[r]
        for i, (grad, spec) in enumerate(zip(grads, param_specs)):
            if spec.kind == "all_reduce":
                assert torch.equal(layout.full_view(flat, i), grad.to(layout.full_view(flat, i).dtype))
            else:
                rows = torch.chunk(grad.reshape(-1) if grad.dim() == 0 else grad, ways) if grad.numel() else ()
                want = rows[r] if r < len(rows) else None
                got = layout.local_view(out, i)
                assert got.numel() == (0 if want is None else want.numel())
                if want is not None:
                    assert torch.equal(got.reshape(want.shape), want.to(got.dtype))
        starts = sorted((bk.start, bk.start + bk.size) for bk in layout.buckets)
        assert all(a[1] <= b[0] for a, b in zip(starts, starts[1:]))
        assert layout.buckets[-1].counters and not any(bk.counters for bk in layout.buckets[:-1])


def test_counters_round_trip_exactly_in_a_float32_buffer() -> None:
    """A total weight of 2**24 + 1 tokens is not a float32, yet reads back exact (split in two float32 values);
    each rank's slots receive only its own values."""
    layout = FlatLayout(
        [ParamSpec((2,), torch.float32, "all_reduce")], world=3, rank=1, device=torch.device("cpu"), bucket_elems=100
    )
    flat = torch.zeros(layout.size, dtype=layout.dtype)
    layout.write_counters(flat, layout.local_counters([1], 5, 2.0**24 + 1, 0, 2), None)
    counts = layout.read_counters(flat, None)
    assert layout.dtype == torch.float32
    assert counts.weights == [0.0, 2.0**24 + 1, 0.0] and counts.per_rank == [0, 5, 0]
    assert counts.participation == [1] and counts.modes == [0, 2, 0] and counts.nonfinite == []


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(SHAPES, min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    m=st.integers(1, 4),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_first_gradient_copied_then_added_bit_for_bit(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, m: int, transposed: bool, seed: int
) -> None:
    """Into a buffer of garbage (NaN), the first gradient is copied and the next ones added, in the buffer's
    dtype, giving the bits of the same sum done by hand, for any shape, non-contiguous gradients included
    (the hooks' direct path) and a dtype the buffer converts from (the general path); a NaN stays a NaN."""
    g = torch.Generator().manual_seed(seed)
    layout = FlatLayout([ParamSpec(s, dtype, "all_reduce") for s in shapes], 1, 0, torch.device("cpu"), 7)
    flat = torch.full((layout.size,), float("nan"), dtype=layout.dtype)
    for i, shape in enumerate(shapes):
        grads = [torch.randn(shape[::-1] if transposed else shape, generator=g).to(dtype) for _ in range(m)]
        grads = [x.permute(tuple(reversed(range(x.dim())))) if transposed else x for x in grads]
        if grads[0].numel() and seed % 3 == 0:
            grads[-1][(0,) * grads[-1].dim()] = float("nan")  # kept through the copy and the adds
        want = grads[0].to(layout.dtype).clone()
        for k, grad in enumerate(grads):
            layout.add(flat, i, grad, first=k == 0)
            if k:
                want.add_(grad.to(layout.dtype))
        got = layout.full_view(flat, i)
        assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (shape, dtype, transposed)

