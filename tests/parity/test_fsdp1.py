"""gradagg.parity.fsdp1: FSDP1's per-rank pieces of a gradient put together, or named when they cannot be (one
process; the 2-rank runs are in test_check.py)."""

from __future__ import annotations

import torch

from gradagg.parity.fsdp1 import whole
from gradagg.parity.shards import assemble
from gradagg.parity.types import FlatPiece, Unread

GROUP = (0, 1, 2)


def pieces(parts: list[torch.Tensor | None], shape: tuple[int, ...] = (2, 3)) -> dict[int, dict[str, FlatPiece]]:
    """Rank r holds ``parts[r]`` (None: no gradient; its size is the part's, 0 for None)."""
    return {r: {"w": FlatPiece(p, 0 if p is None else p.numel(), shape, GROUP)} for r, p in enumerate(parts)}


def test_the_pieces_in_rank_order_are_the_whole() -> None:
    """A 2x3 weight over 3 ranks as FSDP1 leaves it: 4 elements, none, 2; every rank reads the whole."""
    g = torch.arange(6.0).reshape(2, 3)
    got = assemble(pieces([g.reshape(-1)[:4], None, g.reshape(-1)[4:]]))
    assert all(torch.equal(got[r]["w"], g) for r in GROUP), got


def test_no_gradient_on_any_rank_is_absent_not_zero() -> None:
    results = {r: {"w": FlatPiece(None, n, (2, 3), GROUP)} for r, n in enumerate([4, 0, 2])}
    assert whole("w", results[0]["w"], results) is None


def test_what_does_not_fit_is_named() -> None:
    """A rank whose part has no gradient while the others have one; parts that do not make the shape; a rank that
    read it otherwise: each an Unread naming the parameter and what is wrong."""
    g = torch.arange(6.0)
    one_missing = pieces([g[:4], None, g[4:]])
    one_missing[1]["w"] = FlatPiece(None, 1, (2, 3), GROUP)
    short = pieces([g[:4], None, g[4:5]])
    other = pieces([g[:4], None, g[4:]])
    other[2]["w"] = FlatPiece(g[4:], 2, (6,), GROUP)
    for results, words in ((one_missing, "rank(s) [1] has no gradient"), (short, "5 elements, not the 6"),
                           (other, "not on every one of them alike")):
        got = whole("w", results[0]["w"], results)
        assert isinstance(got, Unread) and "'w' is an FSDP1 gradient" in got.why and words in got.why, got
