"""Two forwards per microbatch in the shards forms (FSDP2, FSDP1) while another rank pads: the padding replays
as many forwards as this rank's last microbatch ran, so the ranks' collectives pair (2 gloo ranks; workers in
tests/torch/workers/two_forwards.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gradagg.testing import run_local_world
from tests.torch.workers import attached_forms, two_forwards

WORLD: dict[str, Any] = {"collective_timeout_s": 10.0, "timeout_s": 120.0}


@pytest.mark.parametrize("form", two_forwards.FORMS)
def test_a_padding_rank_replays_every_forward_of_a_microbatch(form: str) -> None:
    """Every window exact on both ranks against the float64 truth, with the padding the uneven counts need."""
    ranks = run_local_world(two_forwards.two_forwards_world, 2, form, **WORLD)
    bound = 1e-5 if form in attached_forms.DTYPES else 1e-12  # float32 (FSDP1 here), float64
    for rank in ranks:
        for (counts, _), got in zip(two_forwards.WINDOWS, rank):
            assert got["error"] < bound, (form, counts, got)
    assert [max(r[k]["padded"] for r in ranks) for k in range(len(two_forwards.WINDOWS))] == [2, 2, 1, 2], ranks
