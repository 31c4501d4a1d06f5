"""Worker functions for tests/torch/accumulate/test_two_optimizers.py: one accumulator, two attached optimizers.

Muon beside AdamW, a GAN's generator and discriminator: two optimizers over disjoint parameters, both attached.
Each seed draws a random partition of TinyMoE's parameters, the two optimizers' kinds, and per window the counts
of the two ranks (a rank with none included), a clip (none, once over all parameters, or per optimizer) and which
optimizers step in which order; the plain float64 loop over the full batch of each window is the truth.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers import dist as w

MAX = 0.05  # below most windows' norms: the clips change the steps
CLIPS = ("none", "all", "per optimizer")


def plan(seed: int, names: list[str]) -> dict[str, Any]:
    """The same plan on every rank: the partition, the optimizers, and each window's counts, clip and steps."""
    rng = random.Random(seed)
    while True:
        part = {n: rng.randrange(2) for n in names}
        if len(set(part.values())) == 2:
            break
    windows = []
    for k in range(3):
        counts = [rng.randint(0, 3), rng.randint(0, 3)]
        if k == 0:
            counts[rng.randrange(2)] = 0  # a rank with no microbatch in every plan
        counts[rng.randrange(2)] += sum(counts) == 0
        steps = rng.choice([[0, 1], [1, 0], [0], [1]])  # both in either order, or one (a GAN's alternation)
        windows.append({"counts": counts, "clip": rng.choice(CLIPS), "steps": steps})
    return {"part": part, "kinds": [rng.choice(["sgd", "adam"]) for _ in range(2)], "windows": windows}


def _optimizers(model: nn.Module, p: dict[str, Any]) -> list[torch.optim.Optimizer]:
    out: list[torch.optim.Optimizer] = []
    for g, kind in enumerate(p["kinds"]):
        params = [t for n, t in model.named_parameters() if p["part"][n] == g]
        out.append(torch.optim.SGD(params, lr=0.5, momentum=0.5) if kind == "sgd" else torch.optim.Adam(params, lr=0.1))
    return out


def _clip_and_step(model: nn.Module, opts: list[torch.optim.Optimizer], window: dict[str, Any]) -> list[float]:
    """The window's clip and steps, as the user's loop writes them (after finish(), or attached: before it)."""
    norms = []
    if window["clip"] == "all":
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX)))
    for g in window["steps"]:
        if window["clip"] == "per optimizer":
            params = [t for group in opts[g].param_groups for t in group["params"]]
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX)))
        opts[g].step()
    model.zero_grad()
    return norms


def _twin(seed: int, p: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The truth: one process, each window's full batch in one float64 forward, the same clips and steps."""
    model = w.TinyMoE()
    opts = _optimizers(model, p)
    norms = []
    for k, window in enumerate(p["windows"]):
        batches = w.microbatches(sum(window["counts"]), seed=100 * seed + k)
        x, y, route = (torch.cat([b[i] for b in batches]) for i in range(3))
        w.loss_of(model, (x, y, route)).backward()
        norms += _clip_and_step(model, opts, window)
    return {n: t.detach().clone() for n, t in model.named_parameters()}, norms


def two_optimizers_world(seeds: list[int]) -> list[dict[str, Any]]:
    """Per seed: the largest difference from the truth in the weights and in the clips' norms."""
    rank, out = dist.get_rank(), []
    for seed in seeds:
        model = w.TinyMoE()
        p = plan(seed, [n for n, _ in model.named_parameters()])
        opts = _optimizers(model, p)
        acc = MicrobatchAccumulator(model)
        for o in opts:
            acc.attach(o)
        norms = []
        for k, window in enumerate(p["windows"]):
            for b in w.my_share(window["counts"], rank, seed=100 * seed + k):
                with acc.microbatch():
                    w.loss_of(model, b).backward()
            norms += _clip_and_step(model, opts, window)  # the first clip or step finishes the window
        acc.close()
        want, want_norms = _twin(seed, p)
        out.append({
            "seed": seed, "plan": p,
            "error": max(float((t.detach() - want[n]).abs().max()) for n, t in model.named_parameters()),
            "norm_error": max((abs(a - b) for a, b in zip(norms, want_norms)), default=0.0),
            "norms": len(norms) == len(want_norms),
        })
    return out


def refusals_world() -> dict[str, Any]:
    """What cannot work, refused on every rank: a second optimizer sharing a parameter with an attached one; an
    unattached optimizer stepping before the window is finished (rank 1 ran no microbatch)."""
    model = w.TinyMoE()
    shared = list(model.shared.parameters())
    first = torch.optim.SGD([*shared, *model.experts[0].parameters()], lr=0.1)
    overlapping = torch.optim.Adam([*shared[:1], *model.experts[1].parameters()], lr=0.1)
    acc = MicrobatchAccumulator(model)
    acc.attach(first)
    out: dict[str, Any] = {"overlap": w.error_of(lambda: acc.attach(overlapping))}
    rest = torch.optim.Adam([*model.experts[1].parameters(), *model.experts[2].parameters()], lr=0.1)
    for b in w.my_share([2, 0], dist.get_rank()):
        with acc.microbatch():
            w.loss_of(model, b).backward()
    out["unattached_first"] = w.error_of(rest.step)
    first.step()  # finishes the window on every rank
    out["unattached_after"] = w.error_of(rest.step)
    acc.close()
    return out


__all__ = ["plan", "refusals_world", "two_optimizers_world"]
