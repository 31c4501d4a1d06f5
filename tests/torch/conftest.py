"""Fixtures shared by the torch tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def accelerator() -> Iterator[Any]:
    """An ``accelerate.Accelerator(cpu=True)`` (its wrappers refuse to exist without one); reset afterwards,
    since Accelerate keeps its state in process-wide singletons."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
