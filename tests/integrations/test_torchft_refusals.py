"""gradagg.integrations.torchft in one process, against a stand-in for ``torchft.Manager``: the refusals and the
paths that need no second group (the processes and torchft's own manager are in test_torchft.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from gradagg.errors import CollectiveError, GradaggError, WindowError
from gradagg.integrations import _torchft_sums as sums
from gradagg.integrations.torchft import exact
from gradagg.torch import MicrobatchAccumulator


class Work:
    def wait(self) -> bool:
        return True


class OneGroup:
    """A manager whose all-reduce adds what the other groups would send (``others``, one tensor per call in order),
    or fails (``fail=True``: every quorum's; ``fails=k``: the first k quorums'). A failed all-reduce writes NaN over
    the tensor (torchft: it "may be corrupted"), records the error, and ``should_commit()`` is then False.
    ``start_quorum()`` clears the error, as torchft's does, and sets ``slots_after`` participants."""

    def __init__(self, others: list[torch.Tensor] | None = None, fail: bool = False, fails: int = 0,
                 slots_after: int = 2) -> None:
        self.others, self.error = list(others or []), None
        self.fails, self.slots, self.slots_after, self.quorums = (10**6 if fail else fails), 2, slots_after, 0
        self.commits: list[bool] = []

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None) -> Work:
        assert reduce_op == torch.distributed.ReduceOp.SUM  # never torchft's default AVG
        if self.quorums < self.fails:
            self.error = RuntimeError("injected all-reduce error")
            tensor.fill_(float("nan"))
        elif self.others:
            tensor += self.others.pop(0)
        return Work()

    def start_quorum(self) -> None:
        self.quorums, self.error, self.slots = self.quorums + 1, None, self.slots_after

    def should_commit(self) -> bool:
        self.commits.append(self.error is None)
        return self.error is None

    def num_participants(self) -> int:
        return self.slots

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


def window(manager: OneGroup, weights: list[float | None], retries: int = 1) -> tuple[torch.nn.Linear, Any]:
    lin = torch.nn.Linear(2, 1, bias=False)
    ft = exact(manager, MicrobatchAccumulator(lin), group="g0", retries=retries)
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


@pytest.mark.parametrize("retries", [0, 1, 2])
def test_a_failed_all_reduce_drops_the_window_once_the_retries_are_spent(retries: int) -> None:
    """Every all-reduce fails. With retries, the last attempt's window went out (a failed all-reduce may still have
    completed on other groups): one more quorum, sending nothing, would learn whether another group committed it
    (see the 2-process test of that); none did here, so it is skipped."""
    manager = OneGroup(fail=True)
    lin, ft = window(manager, [3.0, 1.0], retries=retries)
    report = ft.finish()
    attempts = 1 + retries + (retries > 0)
    assert not report.committed and report.skipped == (0, 1) and lin.weight.grad is None
    assert manager.commits == [False] * attempts and manager.quorums == attempts - 1
    assert "all-reduce failed" in report.reason and ft.skipped == [0, 1] and report.attempts == attempts


def test_a_failed_all_reduce_is_retried_from_the_group_s_own_gradients() -> None:
    """The first attempt fails and leaves NaN in the travelling buffer; the retry's quorum has this group alone
    (the other died): the step is this group's own token mean, the SUM of its two gradients [1, 1] over its weight
    3 + 1, 0.5 per element, sent again from the gradients acc.finish() left, never from the corrupted buffer."""
    manager = OneGroup(fails=1, slots_after=1)
    lin, ft = window(manager, [3.0, 1.0])
    report = ft.finish()
    assert report.committed and report.applied_in == 0 and report.attempts == 2 and report.skipped == ()
    assert manager.commits == [False, True] and report.per_participant == (4.0,) and report.divisor == 4.0
    assert torch.equal(lin.weight.grad, torch.full((1, 2), 0.5))


@pytest.mark.parametrize("retries", [-1, 1.5, True, "1"])
def test_retries_must_be_a_count(retries: Any) -> None:
    with pytest.raises(GradaggError, match=r"retries=.*an int >= 0"):
        exact(OneGroup(), MicrobatchAccumulator(torch.nn.Linear(1, 1)), retries=retries)


def test_one_exact_per_manager() -> None:
    """torchft keys the state it hands to a healing group by name: a second ReplicaGroups on one manager would
    collide with the first (torchft asserts); refused, naming the fix."""
    from torchft import Manager

    manager = Manager.__new__(Manager)  # register_state_dict_fn needs only its two dicts
    manager._load_state_dict_fns, manager._user_state_dicts = {}, {}
    exact(manager, MicrobatchAccumulator(torch.nn.Linear(1, 1)))
    with pytest.raises(GradaggError, match="one exact\\(\\) per manager"):
        exact(manager, MicrobatchAccumulator(torch.nn.Linear(1, 1)))


def test_groups_weighting_differently_are_refused_on_every_group() -> None:
    """This group weighs its microbatches, the other does not: no divisor is right for both."""
    other = sums.counts(1, 0.0, sums.UNWEIGHTED, [1.0], slots=2, slot=1)
    manager = OneGroup([torch.zeros(2), other])
    lin, ft = window(manager, [3.0])
    with pytest.raises(WindowError, match="1 groups with weights, 1 groups without weights"):
        ft.finish()
    assert manager.commits == [False] and lin.weight.grad is None


def test_a_group_of_another_size_is_refused() -> None:
    """The other group has 2 ranks, this one 1: torchft pairs rank r of each group, so the other's rank 1 has no
    partner; refused (should_commit() False first, so that the group's other ranks are released), naming both sizes."""
    other = sums.counts(1, 5.0, sums.WEIGHTED, [1.0], slots=2, slot=1, size=2)
    manager = OneGroup([torch.zeros(2), other])
    lin, ft = window(manager, [3.0])
    with pytest.raises(CollectiveError, match="group g0, rank 0 of 1: replica groups of 2 ranks and of 1 rank in one"):
        ft.finish()
    assert manager.commits == [False] and lin.weight.grad is None


def test_a_step_with_no_data_anywhere_is_not_committed() -> None:
    manager = OneGroup()
    lin, ft = window(manager, [])
    report = ft.finish()
    assert not report.committed and report.group_microbatches == 0 and manager.commits == [False, False]
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
