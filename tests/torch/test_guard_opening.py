"""An attached optimizer in a plain loop (a framework's), a rank with no microbatch, over every wrapper.

The class of the bug found under FSDP2 with a GradScaler (tests/torch/accumulate/test_amp_fsdp.py): a rank with no
microbatch reached the guard's agreement (an ``all_gather``) while the others waited in the window's opening
collective, and gloo aborted. Here every wrapper, clip then step, 2 gloo ranks, float64 against the one-process
truth (workers in tests/torch/workers/attached_forms.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import attached_forms

WORLD: dict[str, Any] = {"collective_timeout_s": 10.0, "timeout_s": 120.0}


@pytest.mark.parametrize("form", attached_forms.FORMS)
def test_a_rank_without_microbatches_finishes_at_its_clip(form: str) -> None:
    """Every window exact on both ranks (error and the clip's norm within round-off), whichever rank ran
    none; the window no rank ran refused on both (M = 0), and the next window exact again."""
    ranks = run_local_world(attached_forms.attached_world, 2, form, **WORLD)
    for rank in ranks:
        assert len(rank) == len(attached_forms.WINDOWS), rank
        for counts, got in zip(attached_forms.WINDOWS, rank):
            if sum(counts) == 0:
                assert isinstance(got, str) and "WindowError" in got, (counts, got)
                continue
            assert isinstance(got, dict), (form, counts, got)
            bound = 1e-5 if form in attached_forms.DTYPES else 1e-12  # float32, float64 round-off
            assert got["error"] < bound and got["norm"] < bound, (form, counts, got)
