"""DDP's rank-local parameters and its buffers under the accumulator, on a gloo group of one rank in this process.

The 3-rank cases are test_trust_ddp.py's; these run the same wrapper code (gradagg.torch.accumulate.wrappers.ddp) in
the test process itself, where mutation testing (``make mutate``), which starts no world, can reach it. The model is
``y = a * x + b * x``: microbatch k's input c_k is the gradient of every element of ``a`` and ``b``, so each truth is
a sum of c_k over a count, computed here in plain Python.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradagg.errors import GradaggError, WindowError
from gradagg.torch import MicrobatchAccumulator
from tests.torch.workers.ddp_trust import Pair

COEFS = [1.0, 2.0, 4.0]


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    if dist.is_initialized():  # another test left a group: not ours to replace
        pytest.skip("a process group is already initialized in this process")
    kept = os.environ.get("GLOO_SOCKET_IFNAME")
    if kept is None and Path("/sys/class/net/lo").exists():
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback, as gradagg.testing's ranks (read when the group is made)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if kept is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def _model(ignored: bool, dtype: torch.dtype = torch.float64) -> tuple[Pair, DDP]:
    module = Pair().to(dtype)
    if ignored:
        # the only way to fill DDP's parameters_to_ignore (a private static method, as in tests/torch/workers)
        DDP._set_params_and_buffers_to_ignore_for_model(module, ["b"])
    return module, DDP(module)


def _window(acc: MicrobatchAccumulator, model: DDP, weights: list[float] | None, dtype: torch.dtype) -> None:
    for k, c in enumerate(acc.microbatches(COEFS)):
        with acc.microbatch(weight=None if weights is None else weights[k]):
            model(torch.tensor(c, dtype=dtype)).sum().backward()


@pytest.mark.parametrize("weights", [None, [1.0, 2.0, 0.0]], ids=["unweighted", "weighted"])
def test_an_ignored_parameter_is_divided_by_this_ranks_own_count(weights: list[float] | None) -> None:
    module, model = _model(ignored=True)
    acc = MicrobatchAccumulator(model)
    _window(acc, model, weights, torch.float64)
    ledger = acc.finish()
    count = len(COEFS) if weights is None else math.fsum(weights)
    want = math.fsum(COEFS) / count
    assert module.a.grad is not None and module.b.grad is not None
    assert module.a.grad.tolist() == module.b.grad.tolist() == [want] * 3, (module.a.grad, module.b.grad, want)
    assert ledger.rank_local == ("b",) and ledger.rank_local_divisor == count
    assert f"rank-local, not reduced (DDP's parameters_to_ignore), divided by this rank's own count {count:g}: b" in (
        ledger.report())
    acc.close()


def test_without_ignored_parameters_nothing_is_rank_local() -> None:
    module, model = _model(ignored=False)
    acc = MicrobatchAccumulator(model)
    _window(acc, model, None, torch.float64)
    ledger = acc.finish()
    assert ledger.rank_local == () and ledger.rank_local_divisor is None and "rank-local" not in ledger.report()
    assert module.b.grad is not None and module.b.grad.tolist() == [math.fsum(COEFS) / 3] * 3
    acc.close()


def test_a_count_the_ignored_parameters_dtype_cannot_divide_by_is_refused() -> None:
    """A total weight of 3e-39 is below float32's smallest normal: the float32 rank-local ``b`` would become inf."""
    module, model = _model(ignored=True, dtype=torch.float32)
    acc = MicrobatchAccumulator(model)
    _window(acc, model, [1e-39] * 3, torch.float32)
    with pytest.raises(WindowError, match="is below the smallest normal float32") as info:
        acc.finish()
    assert "parameters_to_ignore" in str(info.value) and "'b'" in str(info.value)
    acc.discard()
    assert module.a.grad is None and module.b.grad is None  # discard() drops the rank-local gradient too
    _window(acc, model, [1.0] * 3, torch.float32)  # usable again
    acc.finish()
    want = float(torch.tensor(math.fsum(COEFS), dtype=torch.float32) / 3)  # the float32 sum (exact) divided once
    assert module.b.grad is not None and module.b.grad.tolist() == [want] * 3
    acc.close()


def test_all_zero_weights_are_refused() -> None:
    _, model = _model(ignored=True)
    acc = MicrobatchAccumulator(model)
    _window(acc, model, [0.0] * 3, torch.float64)
    with pytest.raises(WindowError, match="total weight of the window is 0"):
        acc.finish()
    acc.discard()
    acc.close()


def test_ddp_is_held_in_no_sync_and_given_back() -> None:
    """While the accumulator holds DDP, its backward does not reduce (no_sync) and its forward does not broadcast
    buffers; close() gives both back."""
    _, model = _model(ignored=False)
    syncs = model.require_backward_grad_sync
    acc = MicrobatchAccumulator(model)
    assert not model.require_backward_grad_sync
    acc.close()
    assert model.require_backward_grad_sync == syncs


def _sync_flag(model: DDP) -> str:
    """The DDP attribute its forward reads to broadcast buffers (torch renamed it; either is public)."""
    return "forward_sync_buffers" if hasattr(model, "forward_sync_buffers") else "broadcast_buffers"


@pytest.mark.parametrize("broadcast", [True, False])
def test_ddps_buffer_setting_is_off_while_held_and_given_back(broadcast: bool) -> None:
    """DDP's forward broadcasts no buffer while the accumulator holds it (the accumulator does, after the exchange);
    close() gives DDP its own setting back, whichever it was."""
    newer = "forward_sync_buffers" in inspect.signature(DDP).parameters  # broadcast_buffers= warns there
    model = DDP(Pair(), **{"forward_sync_buffers" if newer else "broadcast_buffers": broadcast})
    flag = _sync_flag(model)
    assert getattr(model, flag) is broadcast
    acc = MicrobatchAccumulator(model)
    assert getattr(model, flag) is False
    acc.close()
    assert getattr(model, flag) is broadcast


def test_a_static_graph_is_refused_up_front() -> None:
    with pytest.raises(GradaggError, match=r"DistributedDataParallel\(static_graph=True\) cannot run under no_sync"):
        MicrobatchAccumulator(DDP(Pair(), static_graph=True))


class Unused(torch.nn.Module):
    """``a`` reduced; ``b`` and ``c`` ignored by DDP, ``b`` never reached by a backward (its gradient stays None)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a * x + self.c * x).sum()


def test_an_ignored_parameter_no_backward_reached_stays_absent() -> None:
    """Weights 1, 1, 0 (this rank's count 2): ``c`` is divided by 2, ``b`` (no gradient) stays None, whatever order
    the ignored parameters come in."""
    module = Unused()
    DDP._set_params_and_buffers_to_ignore_for_model(module, ["b", "c"])
    model = DDP(module)
    acc = MicrobatchAccumulator(model)
    for c, weight in zip(COEFS, [1.0, 1.0, 0.0]):
        with acc.microbatch(weight=weight):
            model(torch.tensor(c, dtype=torch.float64)).backward()
    ledger = acc.finish()
    want = math.fsum(COEFS) / 2
    assert module.b.grad is None and module.c.grad is not None and module.c.grad.tolist() == [want] * 2
    assert ledger.rank_local == ("b", "c") and ledger.rank_local_divisor == 2.0
    acc.close()


def test_terms_divided_ahead_leave_an_ignored_parameter_as_its_loss_gave_it() -> None:
    """divisors(): the loss is divided before its backward, so D = 1 and the rank-local ``b`` is not divided again."""
    module, model = _model(ignored=True)
    acc = MicrobatchAccumulator(model)
    div = acc.divisors({"n": 4})
    for c in acc.microbatches(COEFS):
        with acc.microbatch():
            (model(torch.tensor(c, dtype=torch.float64)).sum() / div["n"]).backward()
    ledger = acc.finish()
    assert module.b.grad is not None and module.b.grad.tolist() == [math.fsum(COEFS) / 4] * 3
    assert ledger.rank_local_divisor == 1.0
    acc.close()
