"""Activation-checkpointed blocks under the accumulator: ``checkpoint_wrapper`` (torchtitan's) and
``torch.utils.checkpoint``, under DDP, FSDP2 per wrapped block (both forms) and the full_dtensor layout.

``CheckpointWrapper.named_parameters`` drops ``_checkpoint_wrapped_module.`` from its names while the root's keep it;
the accumulator must not depend on either spelling. Workers in ``tests.torch.workers.checkpointed``: 2 gloo ranks,
token-weighted uneven counts with a rank running none, two windows, against the slow twin on a plain replica.
"""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import checkpointed as wc

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 180.0, "preload": ["torch._dynamo"]}
WINDOWS = [[0, 3], [2, 1]]
# float64 both sides; recomputation replays the same forward, so only the order of the sums differs: <= 20
# token terms below 10 per parameter, each addition rounding by 2**-53 relative: far below 1e-12.
TOL = 1e-12


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_local_world(wc.checkpointed_world, 2, WINDOWS, **WORLD)


@pytest.mark.parametrize("parallel", wc.PARALLEL)
@pytest.mark.parametrize("kind", wc.KINDS)
def test_checkpointed_blocks_are_exact(results: list[dict[str, Any]], kind: str, parallel: str) -> None:
    for rank, r in enumerate(results):
        case = r[f"{kind}, {parallel}"]
        assert "raised" not in case, (rank, case["raised"])
        assert len(case["errors"]) == len(WINDOWS) and max(case["errors"]) < TOL, (rank, case)
