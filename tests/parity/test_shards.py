"""DTensor gradients assembled in the checking process from every rank's local shard (no processes here).

Each rank hands back its local tensor with the DTensor's placements, mesh and coordinate; the checking
process puts the whole tensor together for every rank, as ``full_tensor()`` would, without a collective
in a world the step may have left broken. Pieces are made by hand with ``torch.chunk`` (FSDP2's rows of
dim 0, the last ones shorter), so each expectation is the tensor that was cut.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from gradagg.parity.shards import assemble  # noqa: E402
from gradagg.parity.types import Piece, Unread  # noqa: E402

WHOLE = torch.arange(66, dtype=torch.float64).reshape(11, 6)  # 11 rows: chunks of 6 and 5 on 2 ranks


def _fsdp(whole: torch.Tensor, world: int) -> dict[int, Piece]:
    """FSDP2 over ``world`` ranks: rank r holds chunk r of dim 0 (empty when there are fewer rows than ranks)."""
    chunks = list(torch.chunk(whole, world))
    chunks += [whole[:0]] * (world - len(chunks))
    return {r: Piece(chunks[r].clone(), tuple(whole.shape), ("S(0)",), tuple(range(world)), (world,), (r,))
            for r in range(world)}


def test_uneven_rows_of_dim_0_assemble_to_the_whole_on_every_rank() -> None:
    """6 + 5 rows on 2 ranks; 11 rows on 4 ranks are 3 + 3 + 3 + 2; a 1-row bias on 2 ranks is 1 + 0."""
    for whole, world in ((WHOLE, 2), (WHOLE, 4), (torch.tensor([2.5], dtype=torch.float64), 2)):
        out = assemble({r: {"w": p} for r, p in _fsdp(whole, world).items()})
        for r in range(world):
            assert torch.equal(out[r]["w"], whole), (world, r)


def test_hsdp_assembles_within_each_replica_and_keeps_replicas_apart() -> None:
    """Mesh [[0, 1], [2, 3]], placements (Replicate, Shard(0)): replica 1 holds another tensor than replica 0.

    Ranks 0 and 1 get replica 0's whole, ranks 2 and 3 replica 1's: a replica that was not all-reduced
    is seen on its own ranks, not averaged away.
    """
    other = WHOLE + 1.0
    pieces = {}
    for replica, whole in enumerate((WHOLE, other)):
        for s, chunk in enumerate(torch.chunk(whole, 2)):
            pieces[2 * replica + s] = {"w": Piece(chunk.clone(), (11, 6), ("R", "S(0)"), (0, 1, 2, 3), (2, 2),
                                                  (replica, s))}
    out = assemble(pieces)
    assert torch.equal(out[0]["w"], WHOLE) and torch.equal(out[1]["w"], WHOLE)
    assert torch.equal(out[2]["w"], other) and torch.equal(out[3]["w"], other)


def test_partial_sums_and_replicate_keeps_each_ranks_own() -> None:
    """Partial(sum) of 1 and 2 is 3 on both ranks; Replicate leaves each rank its own tensor."""
    partial = {r: {"p": Piece(torch.full((2,), float(r + 1)), (2,), ("P(sum)",), (0, 1), (2,), (r,))} for r in (0, 1)}
    out = assemble(partial)
    assert out[0]["p"].tolist() == [3.0, 3.0] and out[1]["p"].tolist() == [3.0, 3.0]
    replicate = {r: {"q": Piece(torch.full((2,), float(r)), (2,), ("R",), (0, 1), (2,), (r,))} for r in (0, 1)}
    out = assemble(replicate)
    assert out[0]["q"].tolist() == [0.0, 0.0] and out[1]["q"].tolist() == [1.0, 1.0]


def test_plain_tensors_and_none_pass_through() -> None:
    g = torch.ones(2)
    out = assemble({0: {"a": g, "b": None}})
    assert out[0]["a"] is g and out[0]["b"] is None


def test_a_shard_missing_on_one_rank_is_unread_on_the_others_and_none_where_it_is_missing() -> None:
    """Rank 0 left its shard None; rank 1's shard alone is not the gradient: it says whose is missing."""
    pieces = _fsdp(WHOLE, 2)
    out = assemble({0: {"w": None}, 1: {"w": pieces[1]}})
    assert out[0]["w"] is None
    assert isinstance(out[1]["w"], Unread)
    assert out[1]["w"].why.startswith("'w' is a DTensor gradient (S(0)) here but has none on rank 0"), out[1]["w"].why


_RANK1 = _fsdp(WHOLE, 2)[1]


@pytest.mark.parametrize(("rank1", "message"), [
    (torch.zeros(5, 6), "here but a plain tensor on rank 1"),
    (replace(_RANK1, placements=("R",)), "here but a DTensor (R) of shape [11, 6] on rank 1"),
    (replace(_RANK1, shape=(12, 6)), "here but a DTensor (S(0)) of shape [12, 6] on rank 1"),
    (replace(_RANK1, mesh=(1, 0)), "of shape [11, 6] on the mesh [1, 0] of shape [2] on rank 1"),
])
def test_pieces_that_disagree_are_unread(rank1: object, message: str) -> None:
    """Rank 1's gradient is not the other half of rank 0's DTensor: rank 0's is Unread, saying what rank 1 has."""
    why = assemble({0: {"w": _fsdp(WHOLE, 2)[0]}, 1: {"w": rank1}})[0]["w"]
    assert isinstance(why, Unread) and message in why.why, why


def test_shards_that_do_not_make_the_whole_are_unread() -> None:
    """Each rank claims rows 0..5 of an 11-row tensor: 12 rows put together, not 11."""
    p = _fsdp(WHOLE, 2)
    wrong = Piece(WHOLE[:6].clone(), (11, 6), ("S(0)",), (0, 1), (2,), (1,))
    out = assemble({0: {"w": p[0]}, 1: {"w": wrong}})
    assert isinstance(out[0]["w"], Unread) and "assemble to shape [12, 6], not the DTensor's [11, 6]" in out[0]["w"].why


def test_an_unknown_placement_is_unread_not_guessed() -> None:
    """_StridedShard (FSDP2 with tensor parallel) interleaves rows: concatenating would be wrong."""
    pieces = {r: {"w": Piece(torch.zeros(3), (6,), ("_StridedShard(dim=0, sf=2)",), (0, 1), (2,), (r,))}
              for r in (0, 1)}
    why = assemble(pieces)[0]["w"]
    assert isinstance(why, Unread) and "placement _StridedShard(dim=0, sf=2) is not one parity assembles" in why.why
