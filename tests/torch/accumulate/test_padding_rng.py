"""A padding microbatch changes nothing the next real microbatch sees (issue 30): the RNG and plain attributes.

Workers: tests.torch.workers.padding_rng. A model with dropout and plain Python attributes its forward changes
(an int counter it reads, a list, a dict, a plain tensor), trained in the shards form with seeded uneven counts:
each rank must train as a plain replica that ran only its real microbatches, on its own RNG stream.
"""

from __future__ import annotations

from typing import Any

from gradagg.testing import run_local_world
from tests.torch.workers import padding_rng as pr

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 180.0}
# float64: the gradients are the truth's terms in another order (sums over ranks and microbatches): a few ulps
TOL64 = 1e-12


def test_padding_leaves_the_rng_and_plain_attributes_as_it_found_them() -> None:
    """Seeded uneven counts (seed pr.SEED), 3 windows per style (microbatches() with the replay, bare calls with
    pad=fn) on 2 ranks: the gradients are the truth's (dropout drew the replicas' masks: a padding forward that
    drew from the RNG shifts every later mask of its rank), and each block's int counter, list, dict and plain
    tensor are those of a replica that ran only the rank's real microbatches."""
    ranks = run_local_world(pr.dropout_world, 2, 3, **WORLD)
    padded_later = 0  # windows that follow one where the rank padded: where a drawn RNG would show
    for rank in ranks:
        for before, run in zip([None, *rank], rank):
            where = (pr.SEED, run["style"], run["window"], run["counts"])
            assert run["grad_error"] <= TOL64, (where, run["grad_error"])
            assert run["attributes"] == run["want_attributes"], (where, run["attributes"], run["want_attributes"])
            if before is not None and before["style"] == run["style"] and before["padded"]:
                padded_later += 1
    assert padded_later > 0  # the seeds did make a rank pad before another window


class _Box:
    """A custom object: what attributes_kept does not look inside (its documented boundary)."""

    def __init__(self) -> None:
        self.n = 0


def _fresh() -> Any:
    import torch

    outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for mod in outer.modules():
        mod.calls, mod.name, mod.seen, mod.rows, mod.tags = 0, "a", [1], {"k": 1}, {"x"}
        mod.total, mod.box = torch.zeros(3), _Box()
    return outer


def _snapshot(model: Any) -> list[dict[str, Any]]:
    import torch

    own = set(vars(torch.nn.Module()))
    out = []
    for mod in model.modules():
        attrs = {k: v for k, v in vars(mod).items() if k not in own}
        out.append({k: (id(v), v.tolist() if isinstance(v, torch.Tensor) else
                        v.copy() if isinstance(v, list | dict | set) else v) for k, v in attrs.items() if k != "box"})
    return out


# What a forward may do to a module's plain attributes, each a class of change attributes_kept puts back
CHANGES = {
    "rebind an int": lambda m, r: setattr(m, "calls", m.calls + r.randint(1, 3)),
    "rebind a str": lambda m, r: setattr(m, "name", getattr(m, "name", "") + "b"),
    "append to a list": lambda m, r: m.seen.append(r.random()),
    "rebind a list": lambda m, r: setattr(m, "seen", []),
    "write into a dict": lambda m, r: m.rows.__setitem__(r.choice("kq"), r.random()),
    "add to a set": lambda m, r: m.tags.add(r.random()),
    "add to a tensor in place": lambda m, r: m.total.add_(r.random()),
    "rebind a tensor": lambda m, r: setattr(m, "total", m.total + 1),
    "add an attribute": lambda m, r: setattr(m, f"new{r.randint(0, 2)}", r.random()),
    "delete an attribute": lambda m, r: delattr(m, "name") if "name" in vars(m) else None,
}


def test_attributes_kept_puts_back_every_class_of_change() -> None:
    """Seeded (seed 3030): 200 draws of 1-4 changes, each to a random module of a model, inside attributes_kept;
    after it every plain attribute is bound to the same object with the same contents, and none was added. Every
    class of change was drawn. The boundary: a change inside a custom object is not put back."""
    import random

    from gradagg.torch.accumulate.wrappers.pad_run import attributes_kept

    seed = 3030
    rng, drawn = random.Random(seed), dict.fromkeys(CHANGES, 0)
    for draw in range(200):
        model = _fresh()
        before, modules = _snapshot(model), list(model.modules())
        with attributes_kept(model):
            for _ in range(rng.randint(1, 4)):
                what = rng.choice(list(CHANGES))
                CHANGES[what](rng.choice(modules), rng)
                drawn[what] += 1
        assert _snapshot(model) == before, (seed, draw)
    assert all(drawn.values()), drawn
    model = _fresh()
    with attributes_kept(model):
        model[0].box.n += 1
    assert model[0].box.n == 1  # documented: not seen


def test_rng_kept_puts_back_the_generator() -> None:
    """The CPU generator's state after rng_kept is its state before, whatever the block drew."""
    import torch

    from gradagg.torch.accumulate.wrappers.pad_run import rng_kept

    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    with rng_kept(torch.device("cpu")):
        torch.rand(5)
        torch.nn.functional.dropout(torch.ones(4), 0.5)
    assert torch.equal(torch.rand(3), want)
