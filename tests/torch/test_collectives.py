"""gradagg.torch.collectives: one private issuer, thin wrappers, and ``group`` honoured."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

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


@pytest.mark.parametrize("build", ["microbatch", "pipeline"])
def test_a_launcher_world_without_a_process_group_is_refused(monkeypatch: pytest.MonkeyPatch, build: str) -> None:
    """WORLD_SIZE 2 in the environment (a launcher started two processes) but no process group: each rank would
    accumulate alone, silently; both accumulators refuse when built, naming WORLD_SIZE and the fix."""
    import torch

    from gradagg.errors import GradaggError
    from gradagg.torch import MicrobatchAccumulator, PipelineAccumulator

    stage = SimpleNamespace(group=None, is_last=True, submod=torch.nn.Linear(1, 1), stage_index=0)

    def make() -> object:
        if build == "microbatch":
            return MicrobatchAccumulator(torch.nn.Linear(1, 1))
        return PipelineAccumulator(stage, dp_group=None)

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(GradaggError, match=r"WORLD_SIZE is 2 .*init_process_group.*Accelerator\(cpu=True\)"):
        make()
    for fine in ("1", "0", "two"):  # one process; no launcher's number: nothing to refuse
        monkeypatch.setenv("WORLD_SIZE", fine)
        make()
    monkeypatch.delenv("WORLD_SIZE")
    make()


def test_a_launcher_world_with_its_process_group_runs() -> None:
    """The ranks of a real world with WORLD_SIZE set (as torchrun sets it): built and finished as usual."""
    assert run_local_world(groups.launcher_world, 2, **WORLD) == [2.0, 2.0]
