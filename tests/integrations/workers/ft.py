"""Replica groups under torchft, one process per rank: the worker of tests/integrations/test_torchft.py.

The world's ranks are split into ``groups`` replica groups of ``ranks`` ranks each (or ``sizes[g]`` ranks in group g,
in order: ranks 0 to sizes[0] - 1 are group 0, and so on). Each
group has its own TCPStore (the parent's, by port) and its own ``torchft.Manager``; inside a group the accumulator
reduces over a ``dist.new_group`` of its ranks. The lighthouse runs in the parent. Each rank draws its microbatches
from its own queue of sample keys (``keys_of``), a window per step, and puts back what a report says was skipped
(re-feed), except on the group that fails (it leaves). Every sample is a function of its key (:func:`sample`), so
the parent rebuilds any step's float64 truth from the keys a report says were applied.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradagg.errors import GradaggError

IN_DIM, OUT_DIM = 4, 3


QUORUM_TIMEOUT_S = 20.0  # torchft's quorum timeout here: a rank's first quorum waits for its peers to start


@dataclass(frozen=True)
class Plan:
    """One scenario. ``fail``: (group, iteration): that group abandons that iteration's window after ``fail_after``
    microbatches (all of them: it dies at its all-reduce) and leaves. ``join``: (group, k): that group starts once
    group 0 committed k steps, and heals. ``late_error``: (group, iteration): that group reports an error to its
    manager after its all-reduce completed (its data reached the others; its own commit fails), at the
    ``late_error_at``-th ``should_commit()`` of that ``finish()`` (2: the retry's). ``local_error``:
    (group, iteration): that group reports an error before its all-reduce (it sends nothing; the others wait for
    it until their timeout, ``timeouts`` by group). ``measure``: each step also runs torchft's own averaging (group
    token means, ``manager.allreduce`` AVG). ``retries``: given to ``exact()``. ``sizes``: ranks per group, when
    the groups differ (else ``ranks`` each). ``refusals``: a GradaggError out of ``finish()`` ends the rank with a
    record of it (``refused``: the message, ``elapsed``: the step's seconds; the window's keys lost) instead of
    failing the test. ``lose``: (group, rank, iteration): that one rank of the group abandons that iteration's
    window after ``fail_after`` microbatches and leaves (a rank lost inside a group)."""

    groups: int
    ranks: int = 1
    steps: int = 3
    per_window: tuple[int, ...] = (1, 2, 3)  # microbatches per window, by group: uneven
    samples: tuple[int, ...] = (3, 6, 9)  # samples in each rank's queue, by group
    fail: tuple[int, int] | None = None
    fail_after: int = 1
    late_error: tuple[int, int] | None = None
    late_error_at: int = 1  # which should_commit() of that finish() gets the late error: 2 is the retry's
    local_error: tuple[int, int] | None = None
    timeouts: tuple[float, ...] = ()
    retries: int = 1
    join: tuple[int, int] | None = None
    rejoin: int | None = None  # the failed group comes back (a fresh process) once group 0 committed this many steps
    measure: bool = False
    async_quorum: bool = True
    init_sync: bool = False
    lr: float = 0.1  # 0: a committed step leaves the parameters as they were
    min_replica_size: int = 1
    timeout_s: float = 10.0  # torchft's operation timeout: 4 s expired under CI's load (2 cores, 2 test workers)
    sizes: tuple[int, ...] = ()
    refusals: bool = False
    lose: tuple[int, int, int] | None = None
    fsdp: bool = False  # FSDP2 inside each group: fully_shard over the group's ranks

    def size(self, g: int) -> int:
        """Group ``g``'s ranks."""
        return self.sizes[g] if self.sizes else self.ranks

    def timeout(self, g: int) -> float:
        """Group ``g``'s torchft timeout, in seconds."""
        return self.timeouts[g] if self.timeouts else self.timeout_s

    @property
    def world(self) -> int:
        return sum(self.size(g) for g in range(self.groups))


def keys_of(plan: Plan, group: int, rank: int) -> list[str]:
    return [f"g{group}r{rank}s{i}" for i in range(plan.samples[group])]


def sample(key: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A key's tokens (1 to 6 of them, inputs and targets) and whether it uses the model's ``extra`` layer."""
    seed = zlib.crc32(key.encode())
    gen = torch.Generator().manual_seed(seed)
    tokens = 1 + seed % 6
    x = torch.randn(tokens, IN_DIM, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randn(tokens, OUT_DIM, generator=gen, dtype=torch.float64).to(dtype)
    return x, y, seed % 3 == 0


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(IN_DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, OUT_DIM))
        self.extra = torch.nn.Linear(IN_DIM, OUT_DIM)  # absent from the samples that do not use it

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        return self.body(x) + (self.extra(x) if extra else 0)

    def loss_sum(self, key: str) -> torch.Tensor:
        """The UNSCALED loss of a sample: summed over its tokens (through ``forward``: FSDP2 hooks it)."""
        x, y, extra = sample(key, next(self.parameters()).dtype)
        return ((self(x, extra) - y) ** 2).sum()


_SEEDED = threading.Lock()


def model(dtype: torch.dtype = torch.float32) -> Net:
    with _SEEDED:  # groups as threads share torch's generator
        torch.manual_seed(0)  # every group starts from the same parameters (torchft's init_sync=False)
        return Net().to(dtype)


def ft_world(lighthouse: str, ports: list[int], coord: int, plan: Plan) -> list[dict[str, Any]]:
    """One rank: build its group's manager and accumulator, run the steps; return one record per window, then one
    with what is left (``unconsumed``, ``lost`` with a group that died, ``final``: step and parameters)."""
    firsts = [sum(plan.size(k) for k in range(g)) for g in range(plan.groups)]
    g = max(k for k in range(plan.groups) if firsts[k] <= dist.get_rank())
    # every rank makes every group's process group, in one order (torch.distributed requires it of new_group)
    inner = [dist.new_group(list(range(firsts[k], firsts[k] + plan.size(k)))) for k in range(plan.groups)][g]
    return ft_rank(lighthouse, ports, coord, plan, g, dist.get_rank() - firsts[g], inner)


def ft_thread(lighthouse: str, ports: list[int], coord: int, plan: Plan, g: int) -> list[dict[str, Any]]:
    """Group ``g`` as a thread of the test's own process (one rank a group: no torch.distributed world)."""
    assert plan.ranks == 1
    return ft_rank(lighthouse, ports, coord, plan, g, 0, None)


def ft_rank(lighthouse: str, ports: list[int], coord: int, plan: Plan, g: int, r: int,
            inner: Any) -> list[dict[str, Any]]:
    """Rank ``r`` of group ``g`` (``inner``: the group's process group, None for one rank)."""
    store = dist.TCPStore("127.0.0.1", coord, is_master=False, timeout=datetime.timedelta(seconds=60))
    joiner = plan.join is not None and g == plan.join[0]
    if joiner:
        store.wait([f"committed/{plan.join[1]}"])
    queue = collections.deque(keys_of(plan, g, r))
    records: list[dict[str, Any]] = []
    lost: list[str] = []
    for life in range(1 + (plan.rejoin is not None and plan.fail is not None and g == plan.fail[0])):
        if life:  # the crashed group comes back as a new process would: a fresh model and manager, same replica id
            assert plan.rejoin is not None
            store.wait([f"committed/{plan.rejoin}"])
        net, opt, manager, ft, pg = _group(lighthouse, ports[g], plan, g, r, inner)
        if life:
            _meet(store, "rejoiner", plan.size(g))
        else:
            _meet(store, "joiner" if joiner else "start", plan.size(g) if joiner else _starters(plan))
        try:
            gone = _steps(plan, g, r, net, opt, manager, ft, store, queue, records, life)
            final = (manager.current_step(), _params(net))
        finally:
            manager.shutdown(wait=False)
        if gone is None:
            records.append({"unconsumed": list(queue), "lost": lost, "final": final})
            return records
        pg.abort()  # its connections close, as a process's do when it dies: the others' all-reduce fails at once
        lost += gone
    records.append({"unconsumed": list(queue), "lost": lost})
    return records


def _group(lighthouse: str, port: int, plan: Plan, g: int, r: int, inner: Any) -> tuple[Net, Any, Any, Any, Any]:
    """This rank's model, optimizer, torchft manager, gradagg's ReplicaGroups and torchft's process group."""
    from torchft import Manager, ProcessGroupGloo

    from gradagg.integrations.torchft import exact
    from gradagg.torch import MicrobatchAccumulator

    net = model()
    if plan.fsdp:
        _shard(net, inner)
    opt = torch.optim.SGD(net.parameters(), lr=plan.lr)
    timeout = datetime.timedelta(seconds=plan.timeout(g))
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg, min_replica_size=plan.min_replica_size,
        load_state_dict=net.load_state_dict, state_dict=net.state_dict, replica_id=f"g{g}", store_addr="127.0.0.1",
        store_port=port, rank=r, world_size=plan.size(g), lighthouse_addr=lighthouse,
        use_async_quorum=plan.async_quorum, init_sync=plan.init_sync, timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=QUORUM_TIMEOUT_S), connect_timeout=timeout,
    )
    ft = exact(manager, MicrobatchAccumulator(net, group=inner), group=f"g{g}", retries=plan.retries)
    return net, opt, manager, ft, pg


def _shard(net: Net, inner: Any) -> None:
    """FSDP2 over the group's ranks: the body a unit, then the root, which holds ``extra``. (``extra`` is unused by
    some samples: as a unit of its own, a rank whose microbatch skips it would run one reduce-scatter fewer than its
    peer, which FSDP2 does not allow; in the root's unit FSDP2 reduce-scatters it, zeros where unused, as the
    accumulator configures it.)"""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(inner, "cpu")
    fully_shard(net.body, mesh=mesh)
    fully_shard(net, mesh=mesh)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh: every rank of the group records in one order), else
    ``t``."""
    gather = getattr(t, "full_tensor", None)
    return t if gather is None else gather()  # type: ignore[no-any-return]


def _starters(plan: Plan) -> int:
    return plan.world - (plan.size(plan.join[0]) if plan.join is not None else 0)


def _meet(store: Any, name: str, n: int) -> None:
    """Wait until ``n`` ranks reached here (so that the first quorum finds every starting group, whatever each
    rank's start-up took), on the parent's store."""
    if store.add(name, 1) == n:
        store.set(f"{name}/all", "1")
    store.wait([f"{name}/all"])


def _steps(plan: Plan, g: int, r: int, net: Net, opt: torch.optim.Optimizer, manager: Any, ft: Any, store: Any,
           queue: collections.deque[str], records: list[dict[str, Any]], life: int) -> list[str] | None:
    """Run windows until torchft's step reaches ``plan.steps``; the keys lost when this group dies, else None."""
    for it in range(4 * plan.steps):  # a bound: each failure costs an iteration, never an endless loop
        if manager.current_step() >= plan.steps:
            break
        began = time.monotonic()  # the step's time on this rank: its quorum, window and finish()
        manager.start_quorum()
        start = {n: _full(p.detach()).double().clone() for n, p in net.named_parameters()}
        window = [queue.popleft() for _ in range(min(plan.per_window[g], len(queue)))]
        torchft_avg = _torchft_average(net, manager, window) if plan.measure else None
        died = None
        dies = plan.fail == (g, it) or plan.lose == (g, r, it)
        for i, key in enumerate(ft.microbatches(window)):
            if dies and i == plan.fail_after:
                died = i
                break
            with ft.microbatch(weight=sample(key)[0].shape[0], key=key):
                net.loss_sum(key).backward()
        if not life and dies and (died is not None or plan.fail_after >= len(window)):
            queue.extendleft(reversed(window[died:] if died is not None else []))  # never drawn
            manager.num_participants()  # dies after the step's quorum formed with it (before, it never joined)
            report = ft.abandon("injected failure: this group died mid-window")
            records.append(_record(report, start, net, None, it, -1, time.monotonic() - began))
            return list(report.skipped)
        if plan.local_error == (g, it):
            manager.report_error(RuntimeError("injected: a local error before the all-reduce"))
        if plan.late_error == (g, it):
            _error_at_commit(manager, plan.late_error_at)
        try:
            report = ft.finish()
        except GradaggError as e:
            if not plan.refusals:
                raise
            records.append({"refused": str(e), "elapsed": time.monotonic() - began, "iteration": it})
            return window  # no committed step holds them: this rank leaves with them
        records.append(_record(report, start, net, torchft_avg, it, manager.current_step(), time.monotonic() - began))
        queue.extendleft(reversed(report.skipped))  # re-feed: the next window starts with them
        if report.committed:
            opt.step()
            if g == 0 and r == 0:
                store.set(f"committed/{manager.current_step()}", "1")
            if plan.join is not None and g == 0 and manager.current_step() == plan.join[1]:
                store.wait(["joiner/all"])  # the joining group is about to ask for a quorum: give it this one
                time.sleep(0.5)  # not a bound on anything: only more likely that the next quorum includes it
            if plan.rejoin is not None and g == 0 and manager.current_step() == plan.rejoin:
                store.wait(["rejoiner/all"])  # the joining group is about to ask for a quorum: give it this one
                time.sleep(0.5)  # not a bound on anything: only more likely that the next quorum includes it
        opt.zero_grad()
    return None


def _params(net: Net) -> dict[str, torch.Tensor]:
    return {n: _full(p.detach()).clone() for n, p in net.named_parameters()}


def _error_at_commit(manager: Any, nth: int = 1) -> None:
    """The ``nth`` next ``should_commit()`` first reports a local error: the all-reduce before it completed
    everywhere."""
    commit = manager.should_commit
    calls = [0]

    def once(*args: Any, **kwargs: Any) -> bool:
        calls[0] += 1
        if calls[0] == nth:
            manager.should_commit = commit
            manager.report_error(RuntimeError("injected: a local error after the all-reduce"))
        return bool(commit(*args, **kwargs))

    manager.should_commit = once


def _torchft_average(net: Net, manager: Any, window: list[str]) -> dict[str, torch.Tensor]:
    """torchft's own step on the same window: this group's token mean, then ``manager.allreduce`` (its default,
    AVG: the sum divided by the number of participating groups). One rank a group (its DDP mean is then the rank's)."""
    twin = model()
    twin.load_state_dict(net.state_dict())
    tokens = sum(sample(k)[0].shape[0] for k in window)
    for key in window:
        (twin.loss_sum(key) / max(tokens, 1)).backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in twin.named_parameters()}
    for t in grads.values():
        manager.allreduce(t).wait()
    return grads


def _record(report: Any, start: dict[str, torch.Tensor], net: Net, torchft_avg: Any, it: int,
            step_after: int, elapsed: float) -> dict[str, Any]:
    """What a test needs of one window: the report, the parameters the window started from, the gradients
    ``finish()`` handed out, torchft's step after it (-1 for a group that left) and the step's seconds on this rank
    (from its ``start_quorum()`` to ``finish()``'s return)."""
    grads = {n: None if p.grad is None else _full(p.grad.detach()).clone() for n, p in net.named_parameters()}
    return {"report": report, "start": start, "grads": grads, "torchft_avg": torchft_avg, "iteration": it,
            "step_after": step_after, "elapsed": elapsed}
