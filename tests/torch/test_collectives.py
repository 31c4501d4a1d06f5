"""gradagg.torch.collectives: one private issuer, thin wrappers, and ``group`` honoured."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gradagg.testing import run_local_world
from tests.torch.workers import groups

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}
TORCH_SRC = Path(__file__).resolve().parents[2] / "src" / "gradagg" / "torch"
COLLECTIVE = re.compile(r"\bdist\.(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|send|recv)\b")


def test_is_distributed_honours_group() -> None:
    """On 2 ranks: the default group and a group of both communicate (sum 1 + 2 = 3, counted); a group of rank 0
    alone is one process on rank 0 (its own value, nothing counted), and rank 1, outside it, sends nothing."""
    r0, r1 = run_local_world(groups.groups_world, 2, **WORLD)
    for rank, r in enumerate((r0, r1)):
        for label in ("default", "both"):
            want = {"distributed": True, "rank": rank, "world": 2, "sum": 3.0, "gathered": [0, 1], "counted": 2}
            assert r[label] == want, (label, r[label])
    assert r0["alone"] == {"distributed": False, "rank": 0, "world": 1, "sum": 1.0, "gathered": [0], "counted": 0}
    assert r1["alone"]["distributed"] is False and r1["alone"]["counted"] == 0


def test_only_the_issuer_calls_torch_distributed_collectives() -> None:
    """Every collective of gradagg.torch goes through collectives.py (pure.py, the independent twin, excepted:
    it must not share the code it checks)."""
    callers = {
        str(p.relative_to(TORCH_SRC))
        for p in TORCH_SRC.rglob("*.py")
        if COLLECTIVE.search(p.read_text()) and p.name not in ("collectives.py", "pure.py")
    }
    assert callers == set(), callers
    body = (TORCH_SRC / "collectives.py").read_text()
    assert "all_reduce_max" not in body
    issued = [m.start() for m in COLLECTIVE.finditer(body)]
    assert issued and body.count("_collective(") >= 5  # the definition and one call per tensor/object wrapper
