"""``exact(trainer)`` emits no deprecation warning of its own (issue 25): 2 gloo ranks, the tiny Llama, DDP."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from gradagg.testing import run_local_world  # noqa: E402
from tests.integrations.workers import hf, hf_warnings  # noqa: E402


def test_exact_sets_ddps_buffer_sync_without_a_deprecated_argument() -> None:
    """No warning about DDP's buffer options on any rank, and DDP's forward buffer sync is still off for the tiny
    Llama's constant buffers (what ``broadcast_buffers=False`` did before, through the deprecated argument)."""
    for rank, r in enumerate(run_local_world(hf_warnings.warnings_world, 2, **hf.WORLD)):
        assert r["wrapped"] == "DistributedDataParallel", (rank, r)
        assert r["warnings"] == [] and r["from_gradagg"] == [], (rank, r["warnings"], r["from_gradagg"])
        assert r["forward_sync_buffers"] is False, (rank, r)
