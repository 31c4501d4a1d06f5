"""The seam between the accumulator and its wrappers (gradagg.torch.accumulate.seam).

Three rules, each checked over the source rather than trusted: every wrapper class has every method and attribute of
the ``Wrapper`` protocol with the protocol's parameters; the accumulator's core modules never import a wrapper module
(only the public shell chooses one); and no module outside ``wrappers/`` asks which wrapper it holds (``state.fsdp``,
``state.ddp``, an ``isinstance`` of a wrapper class, a wrapper's name compared).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from gradagg.torch import MicrobatchAccumulator
from gradagg.torch.accumulate import seam
from gradagg.torch.accumulate.wrappers import chooser, ddp, deepspeed, fsdp1, fsdp_shards, fsdp_window, plain

PACKAGE = Path(seam.__file__).parent
WRAPPERS = [plain.Plain, ddp.Ddp, fsdp_window.FsdpWindow, fsdp_shards.FsdpShards, fsdp1.Fsdp1Shards,
            deepspeed.DeepSpeedZero]
CORE = sorted(p for p in PACKAGE.glob("*.py") if p.name not in {"accumulator.py", "__init__.py"})


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(seam.Wrapper).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


@pytest.mark.parametrize("cls", WRAPPERS, ids=lambda c: c.__name__)
def test_every_wrapper_has_the_protocols_methods_with_its_parameters(cls: type) -> None:
    methods = _protocol_methods()
    assert len(methods) >= 15, sorted(methods)  # the protocol was read, not an empty class
    for name, sig in methods.items():
        mine = inspect.signature(getattr(cls, name))
        assert list(mine.parameters) == list(sig.parameters), (cls.__name__, name, mine, sig)
    for attribute in ("name", "sharded", "external", "ways", "shard_rank"):
        assert attribute in seam.Wrapper.__annotations__, attribute


def test_a_plain_modules_wrapper_has_every_attribute_of_the_protocol() -> None:
    acc = MicrobatchAccumulator(torch.nn.Linear(2, 1))
    w = acc.state.wrapper
    assert isinstance(w, plain.Plain) and w.name == "plain"
    assert (w.sharded, w.external, w.ways, w.shard_rank, w.held()) == (frozenset(), frozenset(), 1, 0, {})
    acc.close()


def test_the_chooser_refuses_bad_options_before_anything_is_built() -> None:
    from gradagg.errors import GradaggError

    with pytest.raises(GradaggError, match="fsdp must be"):
        chooser("sharded", "replay")  # type: ignore[arg-type]
    with pytest.raises(GradaggError, match="pad must be"):
        chooser("shards", 3)  # type: ignore[arg-type]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_core_never_imports_a_wrapper(path: Path) -> None:
    """Only the public shell (accumulator.py) imports the wrappers: the core reaches them through the seam."""
    wrapped = [m for m in _imports(path) if "accumulate.wrappers" in m]
    assert not wrapped, (path.name, wrapped)


@pytest.mark.parametrize("path", [*CORE, PACKAGE / "accumulator.py"], ids=lambda p: p.name)
def test_no_module_outside_the_wrappers_asks_which_wrapper_it_holds(path: Path) -> None:
    names = {c.__name__ for c in WRAPPERS} | {"FsdpParams", "DdpHold"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in {"fsdp", "ddp", "unsharded", "padding", "kept"}:
            assert not (isinstance(node.value, ast.Name) and node.value.id in {"state", "st"}), (path.name, node.attr)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            shown = ast.unparse(node)
            assert not any(n in shown for n in names), (path.name, shown)
        if isinstance(node, ast.Compare) and "wrapper.name" in ast.unparse(node):
            raise AssertionError((path.name, ast.unparse(node)))
