"""owner_reduce: for every shard, the sum of its owner's contributions only, in one collective.

The distributed form of :func:`gradagg.reference.owner_sum`, laid out by a
declared :class:`~gradagg.torch.ownership.Ownership`.

Exact for every dtype, in one collective: the buffer holds each shard's raw
bytes, summed as int64 lanes. Only the owner writes a shard's bytes and every
other rank writes zeros, and integer addition of zeros returns the owner's bits
unchanged, whatever they encode: int64 beyond 2**53, NaN payloads, -0.0, complex,
bool. (A float buffer in the promoted dtype cannot: int64 next to float32 went
through float32, and a float sum turns -0.0 into +0.0.) One buffer per dtype
would also be exact, but costs one collective per dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from gradagg.errors import CollectiveError, GradaggError, GradientShapeError, GradientTypeError, IdError
from gradagg.torch.collectives import (
    Group,
    all_gather_into,
    all_reduce_sum,
    device_for,
    get_rank,
    get_world_size,
    is_distributed,
)
from gradagg.torch.ownership import Ownership, numel
from gradagg.torch.placements import ShardId, ShardMap, dtype_name, is_dtensor

Contributions = ShardMap[torch.Tensor] | Iterable[tuple[ShardId, torch.Tensor]]
Collective = Literal["auto", "all_reduce", "all_gather"]


def owner_reduce(
    contributions: Contributions, ownership: Ownership, *, group: Group = None, collective: Collective = "auto"
) -> dict[ShardId, torch.Tensor]:
    """For every shard, the sum of its owner's contributions only; the same result on every rank.

    The distributed form of :func:`gradagg.reference.owner_sum`: each rank
    passes the gradients it holds, keyed by shard, including stale copies of
    shards it only replicates. A replica's value is never read into the sum (its
    slot is written with zeros, not multiplied by zero, so a stale NaN cannot
    leak). Repeated pairs for one shard on its owner add. A shard whose owner
    passed nothing does not appear in the result. One collective per call (after
    the once-per-declaration :meth:`Ownership.verify`).

    The results are views of one flat buffer that is reused by the next call with
    the same ownership only if none of them (or views of them) is still alive.

    Args:
        contributions: shard id -> gradient, or ``(shard id, gradient)`` pairs (repeats add).
        ownership: the declaration, identical on every rank.
        group: a process group, or None for the default one (no group: one process, no communication).
        collective: ``"auto"`` (see :class:`_Layout` for the choice), ``"all_reduce"`` or ``"all_gather"``.

    Returns:
        ``{shard: total}`` in canonical shard order, each total with the declared shape and dtype,
        on :func:`~gradagg.torch.collectives.device_for` ``(group)``.

    Raises:
        IdError: on the rank that passed an undeclared shard.
        GradientShapeError: on the rank that passed a gradient whose shape or dtype differs from the declaration.
        CollectiveError: on every other rank in those two cases (naming the faulty ranks); a declaration
            mismatch (every rank); a failed or timed-out collective.

    >>> own = Ownership.from_tensors({"x": torch.zeros(1), "y": torch.zeros(1)}, owners=0)
    >>> owner_reduce([("x", torch.tensor([1.0])), ("x", torch.tensor([2.0]))], own)
    {'x': tensor([3.])}
    """
    if collective not in ("auto", "all_reduce", "all_gather"):
        raise GradaggError(f"collective must be 'auto', 'all_reduce' or 'all_gather', got {collective!r}")
    ownership.verify(group)
    rank, world = get_rank(group), get_world_size(group)
    local, error = _owned_sums(contributions, ownership, rank)
    if not is_distributed(group):
        if error is not None:
            raise error
        return {s: t.reshape(ownership.spec(s).shape).clone() for s, t in local.items()}
    layout = _Layout(ownership, world, device_for(group))
    present, bad_ranks = layout.run(_use_gather(collective, layout, group), local, error is not None, rank, group)
    if error is not None:
        raise error
    if bad_ranks:
        raise CollectiveError(
            f"rank {rank}: owner_reduce got invalid contributions on rank(s) {bad_ranks} "
            "(their own error names the shard); nothing was reduced"
        )
    return present


# --- owner_reduce helpers ------------------------------------------------------


def _owned_sums(
    contributions: Contributions, ownership: Ownership, rank: int
) -> tuple[dict[ShardId, torch.Tensor], GradaggError | None]:
    """This rank's summed contributions to the shards it owns (caller's tensors, never modified), or an error."""
    pairs = contributions.items() if isinstance(contributions, Mapping) else contributions
    sums: dict[ShardId, torch.Tensor] = {}
    for shard, grad in pairs:
        if shard not in ownership:
            return {}, IdError(f"rank {rank}: contribution for shard {shard!r}, which is not declared in the ownership")
        if not isinstance(grad, torch.Tensor) or is_dtensor(grad):
            what = "a DTensor: pass its local piece, grad.to_local()" if is_dtensor(grad) else type(grad).__name__
            return {}, GradientTypeError(f"rank {rank}: contribution for shard {shard!r} is {what}; expected a tensor")
        spec = ownership.spec(shard)
        if tuple(grad.shape) != spec.shape or grad.dtype != spec.dtype:
            return {}, GradientShapeError(
                f"rank {rank}: gradient of shard {shard!r} has shape={tuple(grad.shape)}, "
                f"dtype={dtype_name(grad.dtype)}; declared {spec.describe()}"
            )
        if spec.owner != rank:
            continue  # a replica: held, maybe stale, never counted
        # repeats may sit on other devices than the first: added on the first's
        sums[shard] = grad.detach() if shard not in sums else sums[shard] + grad.detach().to(sums[shard].device)
    return {s: sums[s] for s in ownership if s in sums}, None


def _use_gather(collective: Collective, layout: _Layout, group: Group) -> bool:
    if collective != "auto":
        return collective == "all_gather"
    # Bytes decide on NCCL, where both collectives run at link speed. Gloo's all_gather on loopback is several
    # times slower than its all_reduce of twice the bytes (bench/bench_training.py, the forced all_gather row of
    # bench/RESULTS.md), so on gloo (and any other backend) the all_reduce is the faster choice whatever the bytes say.
    import torch.distributed as dist

    return dist.get_backend(group) == "nccl" and layout.gather_moves_fewer_bytes()


_ALIGN = 16  # bytes: each shard starts at a multiple of the largest itemsize (complex128), so any dtype can view it
_LANE = torch.int64  # the buffer's element type; gloo and NCCL both sum int64
_LANE_BYTES = 8


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _Layout:
    """Where each shard's bytes live in the one flat buffer of an owner_reduce, for a given world size.

    The buffer is int64 lanes: each shard's raw bytes at a 16-byte aligned offset, then one presence
    flag per shard and one status flag per rank (see the module docstring for why bytes).

    Two collectives can do the owner-only reduction in one call, and they move
    different amounts. With S bytes in all shards and n ranks, a ring
    all_reduce of the full buffer (non-owners write zeros) sends about
    2(n-1)/n * S per rank, while an all_gather of each rank's owned part
    (padded to the largest owner's part, since a collective needs equal sizes)
    sends (n-1) * max_owned. The gather moves fewer bytes when ownership is
    balanced (n * max_owned < 2 * S: half the bytes with n = 2 and an even
    split); the all_reduce when one rank owns most shards. Both are exact: the
    all_reduce adds zeros to the owner's bits, the gather only copies. A
    broadcast per owner would be n collectives: not considered. The choice is made
    from the declaration alone, so every rank makes the same one.
    """

    def __init__(self, ownership: Ownership, world: int, device: torch.device | None = None) -> None:
        self.ownership = ownership
        self.world = world
        self.device = device or torch.device("cpu")
        self.order = list(ownership)
        self.nbytes = {s: numel(ownership.spec(s).shape) * ownership.spec(s).dtype.itemsize for s in self.order}
        self.owned = [ownership.owned_by(r) for r in range(world)]
        self.offsets = self._offsets(self.order)  # byte offsets in the all_reduce buffer
        self.data_lanes = sum(_padded(self.nbytes[s]) for s in self.order) // _LANE_BYTES
        # per rank in the gather: owned bytes + one presence flag per owned shard + one status flag, rounded up
        # to whole 16-byte units so that rank r's part starts aligned too
        lanes = max(self._owned_lanes(r) + len(self.owned[r]) + 1 for r in range(world))
        self.chunk = -(-lanes // (_ALIGN // _LANE_BYTES)) * (_ALIGN // _LANE_BYTES)

    def gather_moves_fewer_bytes(self) -> bool:
        full = self.data_lanes + len(self.order) + self.world  # the all_reduce buffer: data, flags, status
        return self.world * self.chunk < 2 * full

    # --- all_reduce: every shard in one buffer, non-owners write zeros ---------------------------

    def pack_all_reduce(self, local: dict[ShardId, torch.Tensor], bad: bool, rank: int) -> torch.Tensor:
        """This rank's buffer: its owned shards' bytes (unless ``bad``), zeros elsewhere (whatever ``local``
        holds for shards it does not own), then the flags."""
        n = len(self.order)
        buf = self.ownership.pools[0].get(self.data_lanes + n + self.world, _LANE, self.device, zero=False)
        raw = buf.view(torch.uint8)
        mine = {s: local[s] for s in self.owned[rank] if s in local and not bad}  # only an owner's bytes are sent
        for shard in self.order:  # every byte written exactly once: no separate zeroing pass
            self._write(raw, self.offsets[shard], shard, mine.get(shard))
        flags = [1 if s in mine else 0 for s in self.order] + [0] * self.world
        flags[n + rank] = 1 if bad else 0
        buf[self.data_lanes :] = torch.tensor(flags, dtype=_LANE)
        return buf

    def unpack_all_reduce(self, buf: torch.Tensor) -> tuple[dict[ShardId, torch.Tensor], list[int]]:
        """The reduced buffer's shards (views) whose owner contributed, and the ranks that reported an error."""
        n = len(self.order)
        meta = buf[self.data_lanes :].tolist()
        raw = buf.view(torch.uint8)
        result = {s: self._view(raw, self.offsets[s], s) for i, s in enumerate(self.order) if meta[i] != 0}
        return result, [r for r, v in enumerate(meta[n:]) if v != 0]

    # --- all_gather: each rank sends its owned shards only ----------------------------------------

    def pack_all_gather(self, local: dict[ShardId, torch.Tensor], bad: bool, rank: int) -> torch.Tensor:
        """This rank's part: its owned shards' bytes, presence flags and status, padded to the largest part."""
        mine = self.owned[rank]
        chunk = self.ownership.pools[1].get(self.chunk, _LANE, self.device, zero=False)
        raw = chunk.view(torch.uint8)
        for shard, offset in self._offsets(mine).items():
            self._write(raw, offset, shard, None if bad else local.get(shard))
        lanes = self._owned_lanes(rank)
        flags = [0 if bad or s not in local else 1 for s in mine] + [1 if bad else 0]
        chunk[lanes : lanes + len(flags)] = torch.tensor(flags, dtype=_LANE)
        chunk[lanes + len(flags) :].zero_()  # padding up to the largest owner's part
        return chunk

    def unpack_all_gather(self, out: torch.Tensor) -> tuple[dict[ShardId, torch.Tensor], list[int]]:
        """The gathered parts' shards (views) whose owner contributed, and the ranks that reported an error."""
        result: dict[ShardId, torch.Tensor] = {}
        bad_ranks: list[int] = []
        for r in range(self.world):
            part = out[r * self.chunk : (r + 1) * self.chunk]
            lanes = self._owned_lanes(r)
            meta = part[lanes : lanes + len(self.owned[r]) + 1].tolist()
            raw = part.view(torch.uint8)
            for k, (shard, offset) in enumerate(self._offsets(self.owned[r]).items()):
                if meta[k] != 0:
                    result[shard] = self._view(raw, offset, shard)
            if meta[-1] != 0:
                bad_ranks.append(r)
        return {s: result[s] for s in self.order if s in result}, bad_ranks

    def run(self, gather: bool, local: dict[ShardId, torch.Tensor], bad: bool, rank: int,
            group: Group) -> tuple[dict[ShardId, torch.Tensor], list[int]]:
        """Pack, send (all_gather or all_reduce), unpack: the shards whose owner contributed, the ranks in error."""
        if not gather:
            return self.unpack_all_reduce(all_reduce_sum(self.pack_all_reduce(local, bad, rank), group))
        out = self.ownership.pools[2].get(self.world * self.chunk, _LANE, self.device, zero=False)
        return self.unpack_all_gather(all_gather_into(out, self.pack_all_gather(local, bad, rank), group))

    # --- bytes ---------------------------------------------------------------------------------

    def _offsets(self, shards: list[ShardId]) -> dict[ShardId, int]:
        offsets, pos = {}, 0
        for shard in shards:
            offsets[shard] = pos
            pos += _padded(self.nbytes[shard])
        return offsets

    def _owned_lanes(self, rank: int) -> int:
        return sum(_padded(self.nbytes[s]) for s in self.owned[rank]) // _LANE_BYTES

    def _write(self, raw: torch.Tensor, offset: int, shard: ShardId, value: torch.Tensor | None) -> None:
        """The shard's bytes at ``offset``: ``value``'s, or zeros (not ours, or nothing from us); zero padding."""
        nbytes, padded = self.nbytes[shard], _padded(self.nbytes[shard])
        if value is None:
            raw[offset : offset + padded].zero_()  # whatever our (stale) copy holds: it never enters the sum
            return
        raw[offset : offset + nbytes].view(value.dtype).copy_(value.reshape(-1))
        raw[offset + nbytes : offset + padded].zero_()

    def _view(self, raw: torch.Tensor, offset: int, shard: ShardId) -> torch.Tensor:
        spec = self.ownership.spec(shard)
        return raw[offset : offset + self.nbytes[shard]].view(spec.dtype).view(spec.shape)
