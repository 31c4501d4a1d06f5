"""SCRIPT.py's contract, checked in the checking process (no worlds): each violation is one ScriptError line."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gradagg.parity.digest import data_digest, model_digest  # noqa: E402
from gradagg.parity.script import (  # noqa: E402
    ScriptError,
    build_checked,
    full_batch_grads,
    load_script,
    load_window,
)

HEADER = """
import torch

def build_model():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1).double()

def microbatches():
    return [torch.ones(1, 2, dtype=torch.float64), torch.full((3, 2), 2.0, dtype=torch.float64)]

def full_batch_loss(model, microbatches):
    return model(torch.cat(microbatches)).sum()

def step(model, microbatches):
    pass
"""


def _script(tmp_path: Path, extra: str = "", header: str = HEADER) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(header) + textwrap.dedent(extra))
    return str(path)


def test_a_complete_script_loads_and_gives_the_truth(tmp_path: Path) -> None:
    """sum over 4 samples of w . x + b: d/dw = (1 + 3 * 2) per input, d/db = 4."""
    script = load_script(_script(tmp_path))
    grads = full_batch_grads(script, build_checked(script), load_window(script))
    assert grads["weight"].tolist() == [[7.0, 7.0]] and grads["bias"].tolist() == [4.0]


@pytest.mark.parametrize(("extra", "message"), [
    ("del step\n", "defines no step()"),
    ("prepare = 3\n", "prepare is a int, not a function"),
    ("def microbatches():\n    return iter([1])\n", "microbatches() returned a list_iterator, expected a list"),
    ("def microbatches():\n    return []\n", "microbatches() returned an empty list"),
    ("def microbatches():\n    return [torch.rand(2)]\n", "microbatches() returned different data on a second call"),
    ("def microbatches():\n    raise KeyError('data')\n", "microbatches() raised KeyError: 'data'"),
    ("def build_model():\n    return 3\n", "build_model() returned a int, expected a torch.nn.Module"),
    ("def build_model():\n    return torch.nn.ReLU()\n", "build_model() returned a model with no trainable parameter"),
    ("def build_model():\n    return torch.nn.Linear(2, 1).double()\n", "build_model() is not deterministic"),
    ("def full_batch_loss(model, mbs):\n    return model(torch.cat(mbs))\n", "shape [4, 1], expected a scalar"),
    ("def full_batch_loss(model, mbs):\n    return 1.0\n", "full_batch_loss() returned a float, expected a scalar"),
    ("def full_batch_loss(model, mbs):\n    return torch.tensor(1.0)\n", "does not depend on the model's parameters"),
    ("def full_batch_loss(model, mbs):\n    return model(torch.cat(mbs)).sum() * float('nan')\n", "is not finite"),
    ("def full_batch_loss(model, mbs):\n    return model(torch.cat(mbs)).sum() * 0.0\n", "zero on every parameter"),
])
def test_each_contract_violation_is_one_script_error(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ScriptError) as exc:
        script = load_script(_script(tmp_path, extra))
        full_batch_grads(script, build_checked(script), load_window(script))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_sys_exit_at_import_is_a_script_error(tmp_path: Path) -> None:
    with pytest.raises(ScriptError, match=r"importing it raised sys.exit\(4\)"):
        load_script(_script(tmp_path, "import sys\nsys.exit(4)\n"))


def test_a_script_imports_its_neighbours(tmp_path: Path) -> None:
    (tmp_path / "helper_for_parity_test.py").write_text("VALUE = 41\n")
    script = load_script(_script(tmp_path, "import helper_for_parity_test as h\nANSWER = h.VALUE + 1\n"))
    assert script.module.ANSWER == 42


@dataclasses.dataclass
class _Batch:
    tokens: torch.Tensor
    label: str


def test_data_digest_sees_a_changed_entry_anywhere() -> None:
    """Equal windows have equal digests; one changed element, dtype, or field changes it."""
    def window(v: float, label: str = "a", dtype: torch.dtype = torch.float64) -> list[object]:
        return [{"x": torch.tensor([1.0, v], dtype=dtype)}, (_Batch(torch.zeros(2), label), 3)]

    base = data_digest(window(2.0))
    assert data_digest(window(2.0)) == base
    assert data_digest(window(2.5)) != base
    assert data_digest(window(2.0, dtype=torch.float32)) != base
    assert data_digest(window(2.0, label="b")) != base


def test_model_digest_names_parameters_and_buffers() -> None:
    torch.manual_seed(0)
    model = torch.nn.BatchNorm1d(2)
    digest = model_digest(model)
    assert {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"} <= set(digest)
    with torch.no_grad():
        model.running_mean += 1
    assert model_digest(model)["running_mean"] != digest["running_mean"]
