"""Loss terms divided ahead: :meth:`~gradagg.torch.MicrobatchAccumulator.divisors` counts every term's global total."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

from gradagg.errors import CollectiveError, GradaggError
from gradagg.torch.accumulate.window import check_weight
from gradagg.torch.collectives import Group, all_reduce_sum, device_for, get_rank, get_world_size


def local_terms(local: Mapping[str, object]) -> list[tuple[str, float]]:
    """The terms as ``(name, count)``, each count a finite non-negative number.

    Raises:
        GradaggError: a name that is not a string, or a count that is not a non-negative number.
    """
    items = []
    for name, value in local.items():
        if not isinstance(name, str):
            raise GradaggError(f"divisors(): term names are strings, got {name!r}")
        v = check_weight(value)
        count = float(v) if isinstance(v, float) else float(v.double().item())
        if not math.isfinite(count) or count < 0:
            raise GradaggError(f"divisors(): term {name!r} has count {count}; a count must be finite and non-negative")
        items.append((name, count))
    return items


def count_terms(local: Mapping[str, object], group: Group) -> dict[str, float]:
    """Sum each term's count over the ranks in one float64 all_reduce (exact for whole counts below 2**53).

    An invalid count on one rank travels as a flag in that same all_reduce, so every rank raises at once
    (none is left waiting for a collective the faulty rank never joins).

    Raises:
        CollectiveError: the ranks named different terms (every rank raises).
        GradaggError: a count that is not a finite non-negative number on any rank; a term totalling 0 over
            all ranks, or beyond float64 (every rank raises).
    """
    try:
        items, error = local_terms(local), None
    except GradaggError as exc:
        items, error = [(str(n), 0.0) for n in local], exc
    world, rank, n = get_world_size(group), get_rank(group), len(items)
    names = [name for name, _ in items]
    vec = torch.zeros(n + 2 * world, dtype=torch.float64)
    vec[:n] = torch.tensor([c for _, c in items], dtype=torch.float64)
    vec[n + rank] = float(int(hashlib.sha256(repr(names).encode()).hexdigest()[:12], 16))  # < 2**48: exact
    vec[n + world + rank] = 0.0 if error is None else 1.0
    got = all_reduce_sum(vec.to(device_for(group)), group).tolist()
    hashes, flags = got[n : n + world], got[n + world :]
    differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if differ:
        raise CollectiveError(
            f"rank {rank}: divisors() got other term names on rank(s) {differ} than on rank 0 (here: {names}); "
            "every rank must name the same terms"
        )
    if error is not None:
        raise error
    bad = [r for r, f in enumerate(flags) if f != 0]
    if bad:
        raise GradaggError(f"rank {rank}: divisors() refused on every rank: rank(s) {bad} gave an invalid count")
    return _checked_totals(dict(zip(names, got[:n])), world)


def _checked_totals(totals: dict[str, float], world: int) -> dict[str, float]:
    for name, total in totals.items():
        if total == 0:
            raise GradaggError(f"divisors(): term {name!r} totals 0 over all {world} ranks: nothing to divide it by")
        if not math.isfinite(total):
            raise GradaggError(f"divisors(): term {name!r} totals {total} over all {world} ranks: beyond float64")
    return totals

__all__ = ["count_terms", "local_terms"]
