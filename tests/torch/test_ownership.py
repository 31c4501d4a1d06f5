"""Ownership and owner_reduce in one process, the mismatch message, and the import boundary."""

from __future__ import annotations

import subprocess
import sys

import pytest

import torch
from gradagg.errors import CollectiveError, GradientShapeError, IdError
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
