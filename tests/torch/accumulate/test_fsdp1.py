"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) is not supported yet: refused at construction on every
rank, naming FSDP1 and what works (FSDP2's ``fully_shard``), not with a confusing comparison of its flat shards.
2 gloo ranks, FSDP1 on the CPU (``device_id=cpu``); workers in ``tests.torch.workers.fsdp1``."""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import fsdp1

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0}


@pytest.mark.parametrize("how", ["orig_params", "flat_params", "nested", "inner", "named"])
def test_fsdp1_is_refused_on_every_rank_naming_it(how: str) -> None:
    """Before: a CollectiveError comparing the ranks' flat shards (use_orig_params=True), or accepted silently
    (use_orig_params=False: its FlatParameter taken as one parameter, averaged by FSDP every microbatch)."""
    for said in run_local_world(fsdp1.fsdp1_world, 2, how, **WORLD):
        assert said.startswith("GradaggError: ") and "FSDP1" in said and "fully_shard" in said, said
