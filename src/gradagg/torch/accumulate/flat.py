"""The accumulator's flat buffer: the counters and every gradient, in buckets of one collective each.

Parameters go into buckets in reverse order (the last parameters get their gradients first in backward,
so their bucket can be sent first, as DDP does), up to a size cap; a bucket holds one kind:

* ``all_reduce``: each parameter's whole gradient, summed over every rank of the group (plain and DDP
  parameters);
* ``reduce_scatter``: FSDP2 parameters (DTensors sharded on dim 0), laid out the way a reduce-scatter
  wants them: ``ways`` equal segments, segment r holding every parameter's rows of shard rank r
  (``torch.chunk`` rows, padded to equal size), so rank r receives the sum of its own shard. On an HSDP
  mesh that segment is then all-reduced over the replicas.

The last bucket (holding the first parameters) also carries the counters at the start of each of its
segments, so the counts travel with the gradients: every rank writes its counters into every segment,
and every rank receives their sum. Complex gradients are stored as their real view (two reals each).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Literal

import torch

from gradagg.torch.buffers import ReusableBuffer
from gradagg.torch.placements import local_tensor

Kind = Literal["all_reduce", "reduce_scatter", "external"]  # external: counted here, reduced elsewhere
# One slot per rank each. A rank's total weight travels as the four 16-bit pieces of its float64 bits: whole
# numbers below 2**16 are exact in any buffer dtype (float32 at least), and in a rank's own slot every other
# rank adds 0, so the float64 arrives bit for bit whatever the model's dtype (a float32 slot would turn
# weight=1e39 into inf).
_WEIGHT_PIECES = tuple(f"weight_{k}" for k in range(4))
# The accumulator's identity (serial, fingerprint: see gradagg.torch.accumulate.lifetime), 32 bits each, in 16-bit
# pieces too: every rank reads every rank's, so ranks that finish different accumulators all refuse.
_IDENTITY_PIECES = tuple(f"identity_{k}" for k in range(4))
_FIELDS = ("m", *_WEIGHT_PIECES, "status", "mode", "nonfinite", *_IDENTITY_PIECES)


@dataclass(frozen=True)
class Counts:
    """The counters of a window after the collective, as Python numbers.

    Attributes:
        participation: per parameter, microbatches with a gradient, summed over ranks.
        per_rank: M of each rank.
        weights: each rank's total weight, the float64 it sent, bit for bit (whatever the buffer dtype).
        status: each rank's status code (0: fine).
        modes: each rank's weighting code (see ``ledger.WEIGHTING``).
        nonfinite: ranks whose local gradient sums were not finite (checked only with ``nonfinite="raise"``).
        identities: each rank's accumulator identity ``(serial, fingerprint)``, both below 2**32.
    """

    participation: list[int]
    per_rank: list[int]
    weights: list[float]
    status: list[int]
    modes: list[int]
    nonfinite: list[int]
    identities: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter: its full gradient's shape and dtype, and its kind."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: Kind


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient lives: in bucket ``bucket``, at ``offset`` within each segment."""

    bucket: int
    offset: int
    shape: tuple[int, ...]
    is_complex: bool
    rows: int  # dim 0 of the full gradient (1 for a 0-d one)
    row: int  # real elements per row
    chunk: int  # rows per segment: all rows for all_reduce, ceil(rows / ways) for reduce_scatter
    local_rows: int  # rows of this rank's shard (reduce_scatter); all rows for all_reduce


@dataclass
class Bucket:
    """One collective's worth of the buffer: ``ways`` segments of ``seg`` elements from ``start``."""

    kind: Kind
    start: int
    seg: int
    ways: int
    out: int  # start of this rank's received segment in the output buffer (reduce_scatter), else -1
    params: list[int]
    counters: bool

    @property
    def size(self) -> int:
        return self.seg * self.ways


def buffer_dtype(specs: list[ParamSpec]) -> torch.dtype:
    """One dtype for every gradient and the counters: at least float32 (whole counts exact up to 2**24).

    >>> buffer_dtype([ParamSpec((2,), torch.bfloat16, "all_reduce"), ParamSpec((), torch.complex128, "all_reduce")])
    torch.float64
    """
    dtype = torch.float32
    for s in specs:
        dtype = torch.promote_types(dtype, real_dtype(s.dtype))
    return dtype


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient of ``dtype`` is stored in (a complex one as its real parts).

    >>> real_dtype(torch.complex64)
    torch.float32
    """
    return torch.empty(0, dtype=dtype).real.dtype if dtype.is_complex else dtype


class FlatLayout:
    """The buckets, slots and counters of one accumulator, for one world size and device.

    Args:
        specs: one per parameter, in the accumulator's order.
        world: ranks in the group (counter slots per field).
        rank: this rank in the group.
        device: where the buffer lives (the collective's device).
        bucket_elems: cap on a bucket's size in elements (a larger parameter gets a bucket of its own).
        ways: shard ranks of the FSDP mesh dimension (reduce_scatter buckets), and ``shard_rank`` this rank's.
    """

    def __init__(
        self,
        specs: list[ParamSpec],
        world: int,
        rank: int,
        device: torch.device,
        bucket_elems: int,
        ways: int = 1,
        shard_rank: int = 0,
    ) -> None:
        self.world, self.rank, self.device, self.ways, self.shard_rank = world, rank, device, ways, shard_rank
        self.dtype = buffer_dtype(specs)
        self.n_params = len(specs)
        self.n_counters = len(specs) + len(_FIELDS) * world
        self.slots: list[Slot] = [self._slot(s) for s in specs]
        self.buckets: list[Bucket] = []
        self._plan(specs, max(1, bucket_elems))
        self._copies_first = all(b.kind != "reduce_scatter" for b in self.buckets)
        # The hooks call add() once per parameter and microbatch: a real all_reduce slot is written through a
        # strided view of the buffer made in one call, the gradient taken as it is (no reshape, no .to()).
        self._direct: list[tuple[int, tuple[int, ...]] | None] = [self._direct_slot(s) for s in self.slots]

    # --- planning ------------------------------------------------------------------------------

    def _slot(self, spec: ParamSpec) -> Slot:
        rows = spec.shape[0] if spec.shape else 1
        per_row = math.prod(spec.shape[1:]) * (2 if spec.dtype.is_complex else 1)
        if spec.kind == "all_reduce":
            return Slot(-1, 0, spec.shape, spec.dtype.is_complex, rows, per_row, rows, rows)
        chunk = -(-rows // self.ways)
        local = max(0, min(rows, (self.shard_rank + 1) * chunk) - self.shard_rank * chunk)
        return Slot(-1, 0, spec.shape, spec.dtype.is_complex, rows, per_row, chunk, local)

    def _plan(self, specs: list[ParamSpec], cap: int) -> None:
        groups: list[tuple[Kind, list[int]]] = []
        size = 0
        for i in reversed(range(len(specs))):
            if specs[i].kind == "external":
                continue
            width = self.slots[i].chunk * self.slots[i].row * (1 if specs[i].kind == "all_reduce" else self.ways)
            if not groups or groups[-1][0] != specs[i].kind or (size + width > cap and groups[-1][1]):
                groups.append((specs[i].kind, []))
                size = 0
            groups[-1][1].append(i)
            size += width
        if not groups:
            groups.append(("all_reduce", []))
        start = out = 0
        self.gaps: list[int] = []  # all_reduce padding elements, zeroed at a window's start (never written)
        for b, (kind, params) in enumerate(groups):
            final = b == len(groups) - 1
            seg = self.n_counters if final else 0
            for i in params:
                s = self.slots[i]
                if s.is_complex and seg % 2:  # a complex view needs an even offset
                    self.gaps.append(start + seg)
                    seg += 1
                self.slots[i] = Slot(b, seg, s.shape, s.is_complex, s.rows, s.row, s.chunk, s.local_rows)
                seg += s.chunk * s.row
            if seg % 2:  # every bucket starts at an even offset
                self.gaps.append(start + seg)
                seg += 1
            ways = self.ways if kind == "reduce_scatter" else 1
            self.buckets.append(Bucket(kind, start, seg, ways, out if kind == "reduce_scatter" else -1, params, final))
            start += seg * ways
            if kind == "reduce_scatter":
                out += seg
        self.size, self.out_size = start, out

    def _direct_slot(self, s: Slot) -> tuple[int, tuple[int, ...]] | None:
        """A real all_reduce slot's start in the buffer and its contiguous strides (None for the other slots)."""
        if s.bucket < 0 or s.is_complex or self.buckets[s.bucket].kind != "all_reduce":
            return None
        strides, step = [], 1
        for n in reversed(s.shape):
            strides.append(step)
            step *= n
        return self.buckets[s.bucket].start + s.offset, tuple(reversed(strides))

    # --- buffers ---------------------------------------------------------------------------------

    def fresh(self, pool: ReusableBuffer) -> torch.Tensor:
        """The input buffer of a new window (reused from ``pool`` when no view of it is alive).

        With only all_reduce buckets it is *not* zeroed (one pass saved): a parameter's first gradient of
        the window is copied in (:meth:`add` with ``first``), a slot never written is zeroed when its
        bucket leaves (:meth:`zero_slot`), the counters are written whole, and the padding is zeroed here.
        Reduce-scatter buffers, whose shard padding is summed too, are zeroed whole.
        """
        if any(b.kind == "reduce_scatter" for b in self.buckets):
            return pool.get(self.size, self.dtype, self.device, zero=True)
        flat = pool.get(self.size, self.dtype, self.device, zero=False)
        if self.gaps:
            flat[torch.tensor(self.gaps, device=self.device)] = 0
        return flat

    def copies_first(self) -> bool:
        """Whether a slot's first gradient must be copied in rather than added (see :meth:`fresh`)."""
        return self._copies_first

    def zero_slot(self, flat: torch.Tensor, i: int) -> None:
        """Zero parameter ``i``'s slot (it got no gradient this window on this rank)."""
        s = self.slots[i]
        bk = self.buckets[s.bucket]
        flat[bk.start + s.offset : bk.start + s.offset + s.chunk * s.row * bk.ways].zero_()

    def output(self, pool: ReusableBuffer) -> torch.Tensor | None:
        """The buffer this rank's reduce-scatter segments land in (None without FSDP parameters)."""
        return pool.get(self.out_size, self.dtype, self.device, zero=False) if self.out_size else None

    def segments(self, flat: torch.Tensor, b: int) -> torch.Tensor:
        """Bucket ``b`` of ``flat`` as a (ways, seg) view."""
        bk = self.buckets[b]
        return flat[bk.start : bk.start + bk.size].view(bk.ways, bk.seg)

    def received(self, flat: torch.Tensor, out: torch.Tensor | None, b: int) -> torch.Tensor:
        """Where bucket ``b``'s result lives on this rank: the bucket itself, or this rank's segment in ``out``."""
        bk = self.buckets[b]
        if bk.kind == "all_reduce":
            return flat[bk.start : bk.start + bk.size]
        if out is None:  # a reduce_scatter bucket always comes with an output buffer (see output())
            raise RuntimeError("internal error: reduce_scatter bucket without an output buffer")
        return out[bk.out : bk.out + bk.seg]

    # --- gradients -------------------------------------------------------------------------------

    def add(self, flat: torch.Tensor, i: int, grad: torch.Tensor, first: bool = False) -> None:
        """Add parameter ``i``'s full gradient into its slot (shard rows into their segments); copy if ``first``.

        >>> layout = FlatLayout([ParamSpec((2, 2), torch.float32, "all_reduce")], 1, 0, torch.device("cpu"), 100)
        >>> flat = torch.zeros(layout.size)
        >>> layout.add(flat, 0, torch.ones(2, 2).t(), first=True); layout.add(flat, 0, torch.ones(2, 2))
        >>> layout.full_view(flat, 0)
        tensor([[2., 2.],
                [2., 2.]])
        """
        if self._add_direct(flat, i, grad, first):
            return
        s = self.slots[i]
        grad = local_tensor(grad)  # torchtitan's full_dtensor: the unsharded gradient is a Replicate() DTensor
        src = torch.view_as_real(grad.resolve_conj()) if grad.is_complex() else grad
        src = src.reshape(-1).to(device=self.device, dtype=self.dtype)
        seg = self.segments(flat, s.bucket)
        width = s.chunk * s.row
        if self.buckets[s.bucket].kind == "all_reduce":
            dest = seg[0, s.offset : s.offset + width]
            dest.copy_(src) if first else dest.add_(src)
            return
        full = s.rows // s.chunk if s.chunk else 0  # segments filled with `chunk` rows
        if full:
            seg[:full, s.offset : s.offset + width].add_(src[: full * width].view(full, width))
        rest = src.numel() - full * width
        if rest:
            seg[full, s.offset : s.offset + rest].add_(src[full * width :])

    def _add_direct(self, flat: torch.Tensor, i: int, grad: torch.Tensor, first: bool) -> bool:
        """:meth:`add` of a plain gradient into a real all_reduce slot, in the buffer's dtype and device, or False."""
        direct = self._direct[i]
        if (
            direct is None
            or type(grad) is not torch.Tensor  # a DTensor or another subclass: the general path
            or grad.dtype != self.dtype
            or grad.device != flat.device
            or grad.shape != self.slots[i].shape  # the strides are the slot's
            or not flat.is_contiguous()
        ):
            return False
        dest = flat.as_strided(grad.shape, direct[1], flat.storage_offset() + direct[0])
        dest.copy_(grad) if first else dest.add_(grad)
        return True

    def full_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s whole reduced gradient (all_reduce kind), a view of ``flat``."""
        s = self.slots[i]
        bk = self.buckets[s.bucket]
        return self._shaped(flat[bk.start + s.offset : bk.start + s.offset + s.rows * s.row], s, s.shape)

    def local_view(self, out: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's rows of parameter ``i``'s reduced gradient (reduce_scatter kind), a view of ``out``."""
        s = self.slots[i]
        bk = self.buckets[s.bucket]
        start = bk.out + s.offset
        return self._shaped(out[start : start + s.local_rows * s.row], s, (s.local_rows, *s.shape[1:]))

    @staticmethod
    def _shaped(flat: torch.Tensor, s: Slot, shape: tuple[int, ...]) -> torch.Tensor:
        if s.is_complex:
            return torch.view_as_complex(flat.view(*shape, 2))
        return flat.view(shape)

    def divide(self, flat: torch.Tensor, out: torch.Tensor | None, divisor: float) -> None:
        """Divide every reduced gradient by the divisor, one pass per buffer (counters were read before)."""
        if any(b.kind == "all_reduce" for b in self.buckets):
            flat.div_(divisor)
        if out is not None:
            out.div_(divisor)

    # --- counters --------------------------------------------------------------------------------

    def write_counters(self, flat: torch.Tensor, local: list[float], nonfinite: torch.Tensor | None) -> None:
        """Write this rank's counters (``local``, see :meth:`local_counters`) into every segment of the last bucket."""
        values = torch.tensor(local, dtype=torch.float64).to(device=self.device, dtype=self.dtype)
        heads = self.segments(flat, len(self.buckets) - 1)[:, : self.n_counters]
        heads.copy_(values.expand_as(heads))
        if nonfinite is not None:
            heads[:, self._pos("nonfinite") + self.rank] = nonfinite.to(self.dtype)

    def local_counters(
        self, participation: list[int], m: int, weight: float, status: int, mode: int,
        identity: tuple[int, int] = (0, 0),
    ) -> list[float]:
        """This rank's counter values: participation, then its own slot of each per-rank field (others zero)."""
        values = [float(p) for p in participation] + [0.0] * (len(_FIELDS) * self.world)
        bits = struct.unpack("<Q", struct.pack("<d", weight))[0]
        pieces = [(name, (bits >> (16 * k)) & 0xFFFF) for k, name in enumerate(_WEIGHT_PIECES)]
        ident = (identity[0] & 0xFFFFFFFF) | (identity[1] & 0xFFFFFFFF) << 32
        pieces += [(name, (ident >> (16 * k)) & 0xFFFF) for k, name in enumerate(_IDENTITY_PIECES)]
        for name, v in (("m", m), *pieces, ("status", status), ("mode", mode)):
            values[self._pos(name) + self.rank] = float(v)
        return values

    def read_counters(self, flat: torch.Tensor, out: torch.Tensor | None) -> Counts:
        """The reduced counters (after the last bucket's collective)."""
        meta = self.received(flat, out, len(self.buckets) - 1)[: self.n_counters].tolist()

        def slots(name: str) -> list[float]:
            p = self._pos(name)
            return [float(v) for v in meta[p : p + self.world]]

        return Counts(
            participation=[round(v) for v in meta[: self.n_params]],
            per_rank=[round(v) for v in slots("m")],
            weights=[_weight(pieces) for pieces in zip(*(slots(name) for name in _WEIGHT_PIECES))],
            status=[round(v) for v in slots("status")],
            modes=[round(v) for v in slots("mode")],
            nonfinite=[r for r, v in enumerate(slots("nonfinite")) if v != 0],
            identities=[_identity(pieces) for pieces in zip(*(slots(name) for name in _IDENTITY_PIECES))],
        )

    def _pos(self, name: str) -> int:
        return self.n_params + _FIELDS.index(name) * self.world


def _weight(pieces: tuple[float, ...]) -> float:
    """A rank's float64 total weight from its four 16-bit pieces (see ``_FIELDS``)."""
    bits = sum(round(v) << (16 * k) for k, v in enumerate(pieces))
    return float(struct.unpack("<d", struct.pack("<Q", bits))[0])


def _identity(pieces: tuple[float, ...]) -> tuple[int, int]:
    """A rank's accumulator identity ``(serial, fingerprint)`` from its four 16-bit pieces."""
    bits = sum(round(v) << (16 * k) for k, v in enumerate(pieces))
    return bits & 0xFFFFFFFF, bits >> 32


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: whether every element of ``t`` is finite (no host sync).

    >>> bool(all_finite(torch.tensor([1.0, float("nan")])))
    False
    """
    return torch.isfinite(t).all() if t.is_floating_point() or t.is_complex() else torch.ones((), dtype=torch.bool)
