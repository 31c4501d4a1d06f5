"""Rank workers for the exactness checks of owner_reduce and grad_norm (imported by the ranks by name).

Each world returns plain values (bytes as lists of ints, floats as ``float.hex``) that the test compares
across ranks and against the values the parent computed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradagg.torch import Ownership, ShardSpec, clip_grad_norm_, count_collectives, grad_norm, owner_reduce


def exact_values() -> dict[str, torch.Tensor]:
    """One declaration mixing dtypes, with values that a float buffer would round or change.

    int64 beyond 2**53 (and 2**40 + 1, beyond float32's 2**24), the int64 extremes, a negative zero
    (a float sum returns +0.0), a subnormal, a NaN with a payload, an empty shard, bool and complex.
    """
    nan_payload = torch.tensor([0x7FF8_0000_DEAD_BEEF], dtype=torch.int64).view(torch.float64)
    return {
        "big": torch.tensor([2**40 + 1, 2**53 + 1, 2**62 + 1, -(2**63), 2**63 - 1], dtype=torch.int64),
        "f32": torch.tensor([-0.0, 1e-45, 3.0], dtype=torch.float32),
        "f64": torch.cat([nan_payload, torch.tensor([-0.0, 2.0**-1074], dtype=torch.float64)]),
        "f16": torch.tensor([65504.0, -0.0, 6e-8], dtype=torch.float16),
        "bf16": torch.tensor([[1.5, -0.0]], dtype=torch.bfloat16),
        "c64": torch.tensor([1 + 2j, -0.0 - 3j], dtype=torch.complex64),
        "flag": torch.tensor([True, False, True]),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "empty": torch.zeros(0, 3, dtype=torch.float32),
    }


def owners() -> dict[str, int]:
    """Owners alternate over the 2 ranks in declaration order, so that both ranks send several dtypes."""
    return {name: i % 2 for i, name in enumerate(exact_values())}


def as_bytes(t: torch.Tensor) -> list[int]:
    """The raw bytes of ``t``: what "exact" means here (NaN payloads and signed zeros included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()  # type: ignore[no-any-return]


def owner_reduce_exact_world() -> dict[str, Any]:
    """Every rank passes the values of its owned shards and NaN-filled stale copies of the others."""
    rank = dist.get_rank()
    values = exact_values()
    own = Ownership.from_tensors(values, owners())
    contributions = {}
    for name, t in values.items():
        contributions[name] = t if owners()[name] == rank else _stale(t)
    own.verify()  # once per declaration: not counted below
    out: dict[str, Any] = {}
    for collective in ("all_reduce", "all_gather"):
        with count_collectives() as c:
            got = owner_reduce(contributions, own, collective=collective)  # type: ignore[arg-type]
        out[collective] = {
            "bytes": {s: as_bytes(t) for s, t in got.items()},
            "dtypes": {s: str(t.dtype) for s, t in got.items()},
            "shapes": {s: tuple(t.shape) for s, t in got.items()},
            "collectives": dict(c.by_op),
        }
    # The issue's case: an int64 shard next to a float32 one (the old buffer took their promotion, float32).
    issue = Ownership({"i": ShardSpec((1,), torch.int64, 0), "w": ShardSpec((1,), torch.float32, 1)})
    pairs = {"i": torch.tensor([2**40 + 1]), "w": torch.tensor([1.5])}
    out["issue"] = {s: t.tolist() for s, t in owner_reduce(pairs, issue).items()}
    return out


def _stale(t: torch.Tensor) -> torch.Tensor:
    """A replica's stale copy: NaN (or all bits set) everywhere; never counted."""
    if t.is_floating_point() or t.is_complex():
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, True) if t.dtype == torch.bool else torch.full_like(t, -1)


def norm_dtype_world() -> dict[str, Any]:
    """Rank 0 holds float32 gradients, rank 1 float64 ones (same values): one result dtype and value."""
    rank = dist.get_rank()
    dtype = torch.float32 if rank == 0 else torch.float64
    rep = torch.zeros(3, dtype=dtype, requires_grad=True)
    rep.grad = torch.tensor([0.1, 0.2, 0.3], dtype=dtype)
    mine = torch.zeros(2, dtype=dtype, requires_grad=True)
    mine.grad = torch.tensor([1.0 / 3.0, 2.0 / 7.0], dtype=dtype) * (rank + 1)
    own = Ownership(
        {"rep": ShardSpec((3,), torch.float32, 0), **{f"e{r}": ShardSpec((2,), torch.float32, r) for r in (0, 1)}}
    )
    out: dict[str, Any] = {}
    plain = grad_norm([rep])
    declared = grad_norm([("rep", rep), (f"e{rank}", mine)], ownership=own)
    with count_collectives() as c:
        clipped = clip_grad_norm_([("rep", rep), (f"e{rank}", mine)], 0.5, ownership=own)
    out["plain"] = (str(plain.dtype), float(plain).hex())
    out["declared"] = (str(declared.dtype), float(declared).hex())
    out["clipped"] = (str(clipped.dtype), float(clipped).hex())
    out["collectives"] = dict(c.by_op)
    return out
