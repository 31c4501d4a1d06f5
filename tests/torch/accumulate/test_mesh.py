"""The accumulator's group read from a DeviceMesh (issue 23, item 4): context parallel counted once over dp x cp,
tensor-parallel peers not counted again, FSDP2 over the flattened dp_shard x cp, the dims named in the ledger.

One world of 4 gloo ranks runs every case (workers: ``tests.torch.workers.meshes``); the tests below read its
results. The float64 truths are one process over the whole sequences.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch

from gradagg.errors import GradaggError
from gradagg.testing import run_local_world
from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.accumulate import meshes
from gradagg.torch.accumulate.ledger import Span
from tests.torch.workers import meshes as workers

WORLD: dict[str, Any] = {"collective_timeout_s": 30.0, "timeout_s": 300.0, "preload": ["torch._dynamo"]}
REL = 1e-12  # float64, a few dozen terms summed in another order than the one-process run: a few ulps


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_local_world(workers.mesh_world, 4, 5, **WORLD)


def test_cp_tokens_count_once_over_dp_x_cp(world: list[dict[str, Any]]) -> None:
    """Mesh ("dp", "cp") = (2, 2), 1 and 3 microbatches per dp replica, rank 1 with no valid token: token-mean and
    seq-mean-token-mean are the float64 truth. verl#5983's count (tokens over this cp rank's dp group only) misses
    the other cp rank's tokens: the two cp coordinates' dp-only counts add up to D, each D / 2 on average (the cp
    size), so 1 / factor(cp 0) + 1 / factor(cp 1) = 1, and the gradient is off on every rank."""
    assert world[1]["dp x cp"]["valid"] == 0 and all(w["dp x cp"]["valid"] > 0 for i, w in enumerate(world) if i != 1)
    for r, res in enumerate(world):
        for mode in ("token-mean", "seq-mean-token-mean"):
            case = res["dp x cp"][mode]
            assert case["err"] <= REL, (r, mode, case["err"])
            assert case["divisor"] == world[0]["dp x cp"][mode]["divisor"], (r, mode)
            assert case["counted_over"] == ("dp", "cp") and case["ranks"] == (0, 1, 2, 3), (r, case)
            assert "counted and reduced over dp x cp: global ranks [0, 1, 2, 3]" in case["report"], case["report"]
        tm = res["dp x cp"]["token-mean"]
        assert tm["dp_only_err"] > 0.3 and tm["dp_only_factor"] > 1.5, (r, tm)  # the undercount, seen
    factors = [world[cp]["dp x cp"]["token-mean"]["dp_only_factor"] for cp in (0, 1)]  # ranks 0, 1: cp 0, cp 1
    assert abs(1 / factors[0] + 1 / factors[1] - 1) < 1e-12, factors  # token counts: exact up to one rounding


def test_tp_peers_are_not_counted_again(world: list[dict[str, Any]]) -> None:
    """Mesh ("dp", "cp", "tp") = (1, 2, 2), w split over tp by hand: each tp coordinate counts over its dp x cp
    ranks {tp, tp + 2}; D is the window's T valid tokens (the whole world would count 2T), gradients exact."""
    for r, res in enumerate(world):
        tp = res["tp"]
        assert tp["err"] <= REL, (r, tp["err"])
        assert tp["divisor"] == tp["tokens"] and tp["world_count"] == 2 * tp["tokens"], (r, tp)
        assert tp["counted_over"] == ("dp", "cp") and tp["ranks"] == (r % 2, r % 2 + 2), (r, tp)


def test_fsdp2_over_flattened_dp_shard_cp(world: list[dict[str, Any]]) -> None:
    """FSDP2 on ("dp_shard_cp",) of 4 ranks, the accumulator on ("dp_shard", "cp") = (2, 2), 1 and 3 microbatches:
    FSDP's reduce-scatter summed (its mean undone), divided once by the tokens over dp_shard x cp."""
    for r, res in enumerate(world):
        f = res["fsdp"]
        assert f["err"] <= REL, (r, f["err"])
        assert f["counted_over"] == ("dp_shard", "cp") and f["reduced_over"] == ("dp_shard_cp",), (r, f)
        lines = ["counted over dp_shard x cp: global ranks [0, 1, 2, 3]",  # as docs/howto/rl.md shows them
                 "reduced over dp_shard_cp, FSDP2's mesh: summed (FSDP's own mean not taken), divided once by D"]
        assert "\n".join(lines) in f["report"], f["report"]


def test_a_mesh_over_part_of_the_world(world: list[dict[str, Any]]) -> None:
    """("dp", "cp") of one pipeline stage, ranks {0, 1} or {2, 3}, rank r weighing r + 1: D = 3 or 7."""
    for r, res in enumerate(world):
        want = (0, 1) if r < 2 else (2, 3)
        assert res["stage"] == {"divisor": sum(want) + 2, "ranks": want, "counted_over": ("dp", "cp")}, (r, res)


def test_refuses_an_ambiguous_dim_name(world: list[dict[str, Any]]) -> None:
    for res in world:
        msg = res["refusals"]["sp"]
        assert "['sp']" in msg and "name it 'cp'" in msg and "'tp'" in msg, msg


def test_refuses_an_unnamed_mesh(world: list[dict[str, Any]]) -> None:
    for res in world:
        assert "has no dim names" in res["refusals"]["unnamed"], res["refusals"]["unnamed"]


def test_refuses_a_group_that_disagrees_with_the_mesh(world: list[dict[str, Any]]) -> None:
    for r, res in enumerate(world):
        msg = res["refusals"]["group"]
        want = f"group= holds global ranks {[r - r % 2, r - r % 2 + 1]}, but mesh= says this rank counts over dp x cp"
        assert want in msg, msg


def test_refuses_an_fsdp_mesh_over_other_ranks(world: list[dict[str, Any]]) -> None:
    """FSDP over the dp ranks {cp, cp + 2}, the accumulator over the cp ranks: both of 2, accepted before."""
    for r, res in enumerate(world):
        msg = res["refusals"]["fsdp"]
        assert f"over global ranks {[r % 2, r % 2 + 2]}" in msg and f"ranks {[r - r % 2, r - r % 2 + 1]}" in msg, msg


def test_refuses_what_is_not_a_mesh() -> None:
    with pytest.raises(GradaggError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh, got str"):
        MicrobatchAccumulator(torch.nn.Linear(1, 1), mesh="dp")  # type: ignore[arg-type]


def test_span_lines() -> None:
    """One process without a mesh: no line; a group: its ranks; FSDP2: both groups."""
    assert Span().text() == []
    assert Span(ranks=(0, 1)).text() == ["counted and reduced over the group of global ranks [0, 1]"]
    both = Span(ranks=(0, 1, 2, 3), counted_over=("dp_shard", "cp"), reduced_over=("dp_shard_cp",)).text()
    assert both[0] == "counted over dp_shard x cp: global ranks [0, 1, 2, 3]" and "dp_shard_cp, FSDP2's mesh" in both[1]


def test_data_groups_fuzz() -> None:
    """Seeded: random meshes of 1 to 4 dims (sizes 1 to 3, ranks in a random order), each dim a data or a replica
    dim. groups_along against the definition (the ranks sharing a rank's coordinate on every replica dim), and the
    groups partition the mesh, each of the data dims' product of sizes. The known wrong fixes are caught: the
    data dims' own groups (verl#5983 counting over dp of (dp, cp)) and the whole mesh (tp peers counted)."""
    seed = random.randrange(2**32)
    rnd = random.Random(seed)
    for _ in range(300):
        shape = [rnd.randint(1, 3) for _ in range(rnd.randint(1, 4))]
        names = [rnd.choice(["dp", "dp_shard", "cp", "fsdp", "tp", "pp"]) + str(i) for i in range(len(shape))]
        data = [n for n in names if not n.startswith(("tp", "pp"))]
        ranks = torch.randperm(math.prod(shape), generator=torch.Generator().manual_seed(rnd.randrange(2**31)))
        ranks = ranks.reshape(shape)
        got = meshes.groups_along(ranks, [n.rstrip("0123") for n in names], [n.rstrip("0123") for n in data])
        coords = {int(ranks[idx]): idx for idx in itertools.product(*(range(s) for s in shape))}
        replica = [i for i, n in enumerate(names) if n not in data]
        for g in got:
            want = sorted(r for r, c in coords.items() if all(c[i] == coords[g[0]][i] for i in replica))
            assert g == want, (seed, shape, names, g, want)
        size = math.prod(s for s, n in zip(shape, names) if n in data)
        assert sorted(r for g in got for r in g) == list(range(ranks.numel())), seed
        assert all(len(g) == size for g in got), (seed, shape, names)
    dp_cp = meshes.groups_along(torch.arange(4).reshape(2, 2), ["dp", "cp"], ["dp", "cp"])
    assert dp_cp == [[0, 1, 2, 3]] != meshes.groups_along(torch.arange(4).reshape(2, 2), ["dp", "cp"], ["dp"])
    tp = meshes.groups_along(torch.arange(4).reshape(2, 2), ["dp", "tp"], ["dp"])
    assert tp == [[0, 2], [1, 3]] != meshes.groups_along(torch.arange(4).reshape(2, 2), ["dp", "tp"], ["dp", "tp"])
    print(f"seed {seed}")
