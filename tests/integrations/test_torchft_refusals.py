"""gradagg.integrations.torchft in one process, against a stand-in for ``torchft.Manager``: the refusals and the
paths that need no second group (the processes and torchft's own manager are in test_torchft.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from gradagg.errors import GradaggError, WindowError
from gradagg.integrations import _torchft_sums as sums
from gradagg.integrations.torchft import exact
from gradagg.torch import MicrobatchAccumulator


class Work:
    def wait(self) -> bool:
        return True


class OneGroup:
    """A manager whose all-reduce adds what the other groups would send (``others``, one tensor per call in order),
    or fails (``fail=True``: torchft then records the error and ``should_commit()`` is False)."""

    def __init__(self, others: list[torch.Tensor] | None = None, fail: bool = False) -> None:
        self.others, self.fail, self.error, self.calls = list(others or []), fail, None, 0
        self.commits: list[bool] = []

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None) -> Work:
        assert reduce_op == torch.distributed.ReduceOp.SUM  # never torchft's default AVG
        if self.fail:
            self.error = RuntimeError("injected all-reduce error")
        elif self.others:
            tensor += self.others.pop(0)
        return Work()

    def should_commit(self) -> bool:
        self.commits.append(self.error is None)
        return self.error is None

    def num_participants(self) -> int:
        return 2

    def participating_rank(self) -> int:
        return 0

    def is_participating(self) -> bool:
        return True

    def current_step(self) -> int:
        return 0

    def errored(self) -> Any:
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = e


def window(manager: OneGroup, weights: list[float | None]) -> tuple[torch.nn.Linear, Any]:
    lin = torch.nn.Linear(2, 1, bias=False)
    ft = exact(manager, MicrobatchAccumulator(lin), group="g0")
    for i, w in enumerate(weights):
        with ft.microbatch(weight=w, key=i):
            lin(torch.ones(1, 2)).sum().backward()
    return lin, ft


def test_the_other_group_adds_its_sum_and_count() -> None:
    """This group: 1 microbatch of weight 3, gradient [1, 1]; the other: weight 5, SUM [4, 4] (in slot 1): the step
    is (1 + 4) / (3 + 5) = 0.625 per element."""
    other_sum = torch.tensor([4.0, 4.0])
    other_counts = sums.counts(2, 5.0, sums.WEIGHTED, [2.0], slots=2, slot=1)
    lin, ft = window(OneGroup([other_sum, other_counts]), [3.0])
    report = ft.finish()
    assert report.committed and report.applied and report.per_participant == (3.0, 5.0) and report.divisor == 8.0
    assert torch.equal(lin.weight.grad, torch.full((1, 2), 0.625))  # 5 / 8 is exact in binary


def test_a_failed_all_reduce_drops_the_window() -> None:
    manager = OneGroup(fail=True)
    lin, ft = window(manager, [3.0, 1.0])
    report = ft.finish()
    assert not report.committed and report.skipped == (0, 1) and lin.weight.grad is None
    assert manager.commits == [False] and "all-reduce failed" in report.reason and ft.skipped == [0, 1]


def test_groups_weighting_differently_are_refused_on_every_group() -> None:
    """This group weighs its microbatches, the other does not: no divisor is right for both."""
    other = sums.counts(1, 0.0, sums.UNWEIGHTED, [1.0], slots=2, slot=1)
    manager = OneGroup([torch.zeros(2), other])
    lin, ft = window(manager, [3.0])
    with pytest.raises(WindowError, match="1 groups with weights, 1 groups without weights"):
        ft.finish()
    assert manager.commits == [False] and lin.weight.grad is None


def test_a_step_with_no_data_anywhere_is_not_committed() -> None:
    manager = OneGroup()
    lin, ft = window(manager, [])
    report = ft.finish()
    assert not report.committed and report.group_microbatches == 0 and manager.commits == [False]
    assert isinstance(manager.error, GradaggError) and "no microbatch in any replica group" in str(manager.error)


def test_terms_are_refused() -> None:
    """Each loss term divided by its own count cannot be re-divided across groups."""
    lin = torch.nn.Linear(1, 1)
    with pytest.raises(GradaggError, match=r"terms=\['nll'\]"):
        exact(OneGroup(), MicrobatchAccumulator(lin, terms=("nll",)))


def test_the_module_imports_no_torchft() -> None:
    """The manager is the caller's: importing the integration imports nothing of torchft."""
    code = "import sys, gradagg.integrations.torchft; print('torchft' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
