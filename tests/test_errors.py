"""The error hierarchy: ``except GradaggError`` catches everything gradagg raises; ``except ValueError`` catches
bad input but never a collective's failure (a dead peer, a timeout), which must not be swallowed (issue 22)."""

from __future__ import annotations

import inspect

import pytest

from gradagg import errors
from gradagg.errors import CollectiveError, ContractError, GradaggError, WindowError

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, GradaggError)]
CONTRACTS = [c for c in CLASSES if c not in (GradaggError, CollectiveError)]


def test_every_class_is_found() -> None:
    """The lists below are not empty by accident: every public error class of the module is in them."""
    assert {c.__name__ for c in CLASSES} >= {"GradaggError", "ContractError", "CollectiveError", "WindowError",
                                              "RowShapeError", "PlacementError", "ScriptError"}


@pytest.mark.parametrize("cls", CONTRACTS, ids=lambda c: c.__name__)
def test_contract_errors_are_value_errors(cls: type[GradaggError]) -> None:
    """Bad input and broken contracts stay ValueErrors, for callers who catch those."""
    exc = cls("bad") if cls is not WindowError else WindowError("bad", remedy="do this")
    assert isinstance(exc, ContractError) and isinstance(exc, ValueError) and isinstance(exc, GradaggError)


def test_a_collective_failure_is_not_a_value_error() -> None:
    """A peer that died or timed out is not bad input: ``except ValueError`` around user code must let it through,
    and ``except GradaggError`` still catches it."""
    assert not issubclass(CollectiveError, ValueError)
    with pytest.raises(CollectiveError):
        try:
            raise CollectiveError("rank 0 of 2: all_reduce(sum) over 2 elements failed: timed out")
        except ValueError:  # what a user's loop may wrap around its own parsing
            pytest.fail("except ValueError swallowed a collective failure")
    with pytest.raises(GradaggError):
        raise CollectiveError("x")


def test_a_failed_collective_from_torch_reaches_the_caller() -> None:
    """The real path: a backend's RuntimeError in a collective's ``wait()`` becomes a CollectiveError that an
    ``except ValueError`` does not catch."""
    pytest.importorskip("torch")
    from gradagg.torch.collectives import Pending

    class DeadPeer:
        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

    with pytest.raises(CollectiveError, match="a peer rank died"):
        try:
            Pending(DeadPeer(), "all_reduce(sum)", "2 elements of torch.float32", None).wait()
        except ValueError:
            pytest.fail("except ValueError swallowed a dead peer")


def test_gradagg_error_catches_every_class() -> None:
    for cls in CLASSES:
        exc = cls("x") if cls is not WindowError else WindowError("x")
        with pytest.raises(GradaggError):
            raise exc
