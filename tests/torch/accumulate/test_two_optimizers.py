"""Two optimizers over disjoint parameters, both attached to one accumulator (Muon beside AdamW, a GAN's two).

The first clip or step of a window finishes it and hands out every gradient; the other optimizer steps on them.
2 gloo ranks, several windows, uneven counts with a rank that runs none, a clip between (none, once over all
parameters, or per optimizer), random partitions of the parameters, against the plain float64 full-batch loop
(see tests/torch/workers/two_optimizers.py).
"""

from __future__ import annotations

import collections
from typing import Any

from gradagg.testing import run_local_world
from tests.torch.workers import two_optimizers

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}
TOL = 1e-12  # float64: the accumulator's mean and the full batch's, summed in another order, then 3 steps


def test_two_optimizers_random_partitions() -> None:
    """Seeded plans: every weight and every clip's norm equal the truth's on both ranks; the classes drawn (clip
    kinds, step orders, a lone optimizer's step, a rank with none, both optimizer kinds) are counted and reached."""
    seeds = list(range(6))
    ranks = run_local_world(two_optimizers.two_optimizers_world, 2, seeds, **WORLD)
    reached: collections.Counter[str] = collections.Counter()
    for r0, r1 in zip(*ranks):
        for r in (r0, r1):
            assert r["norms"] and r["error"] <= TOL and r["norm_error"] <= TOL, r
        p = r0["plan"]
        reached.update(p["kinds"])
        for window in p["windows"]:
            reached[f"clip {window['clip']}"] += 1
            reached[f"steps {window['steps']}"] += 1
            reached["a rank with none"] += 0 in window["counts"]
    print(dict(reached))
    wanted = ["sgd", "adam", "clip none", "clip all", "clip per optimizer", "steps [0, 1]", "steps [1, 0]", "steps [0]",
              "steps [1]", "a rank with none"]
    assert all(reached[k] for k in wanted), reached


def test_what_cannot_work_is_refused() -> None:
    """A second optimizer sharing a parameter with an attached one: refused at attach(), naming both. An optimizer
    left unattached that steps before the window is finished: refused on both ranks (the rank with no microbatch
    included); after the attached one's step finished it, it steps."""
    for r in run_local_world(two_optimizers.refusals_world, 2, **WORLD):
        assert r["overlap"] is not None and "already attached over parameter 'shared.weight'" in r["overlap"][1], r
        assert r["unattached_first"] is not None and r["unattached_first"][0] == "WindowError", r
        assert r["unattached_after"] is None, r
