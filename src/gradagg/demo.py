"""``gradagg demo``: distributed training, checked every step against the single-process full-batch gradient.

What the demo shows
-------------------
A small float64 model trains on W gloo processes (2 by default, started here on loopback; under
``torchrun``, the world it was given). Ranks run uneven numbers of microbatches per step (3 and 5 by
default; M in all). Every step, every rank also computes alone the gradient of the whole global
batch, ``grad of (1/M) sum_i loss_i`` over all M microbatches: the ground truth. The demo prints
how far each way of combining the ranks' gradients lands from it:

* **gradagg**: :class:`~gradagg.torch.MicrobatchAccumulator` (sum over every microbatch
  of every rank, divided by the counted M; absent counts as zero) and
  :func:`~gradagg.torch.owner_reduce` for the replicated ``head_b`` (owner only).
* **divide by participation**: each parameter's sum divided by the number of microbatches in which
  it got a gradient. Wrong for any expert that some microbatch skipped.
* **DDP (W x m_r)**: each rank averages its own m_r microbatches, then ranks are averaged (what
  DDP with ``no_sync`` and ``loss / m_r`` does). Wrong whenever the m_r differ.
* **sum every replica** / **first replica**: ``head_b``'s copies are added over ranks, or taken from
  rank 0, instead of from the owner; the non-owners' copies are stale.

The model is a top-1 mixture of experts: a router sends each token to one expert, so an expert
that no token of a microbatch chose does not run there and its parameters are *absent* (no
gradient, not a zero gradient). The last rank's data come from a second domain, "B", which adds a
linear term ``x . head_b``. ``head_b`` is replicated on every rank (each holds the whole model) and
declared owned by the last rank, the only one whose data use it. Only the owner clears its
gradient (as a ZeRO-1 optimizer zeroes only its own partition), so the other ranks' ``head_b.grad``
is last step's: a stale replica.
On step 0 no stale copy exists yet, so the two replica mistakes happen to be right there.

Each approach trains its own copy of the model from the same start (plain SGD), so the plot
(``--plot``) shows what each error does to the loss, beside the error itself. Exit status 0 when
gradagg's error stayed within the tolerance at every step, 1 otherwise: the demo is itself a check.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradagg.errors import CollectiveError, GradaggError, WindowError

if TYPE_CHECKING:  # torch and matplotlib load only when the demo runs: `gradagg --help` stays fast
    import torch

    Params = dict[str, torch.Tensor]
    Microbatch = tuple[torch.Tensor, torch.Tensor, bool]  # (x [tokens, dim], target [tokens], domain B?)

# float64 round-off: gradagg and the ground truth add the same M terms (|g| of order 1) in different
# orders, which moves the result by a few ulps, M * 2.2e-16 ~ 2e-15. 1e-12 leaves a margin of ~500
# while staying far below the wrong approaches' errors (1e-3 and up).
TOLERANCE = 1e-12
GRADAGG = "gradagg"
APPROACHES = (GRADAGG, "divide by participation", "DDP (W x m_r)", "sum every replica", "first replica")
HEAD = "head_b"  # the replicated parameter with one declared owner (the last rank)
DIM, EXPERTS, TOKENS, LR = 4, 4, 3, 0.3  # tokens per microbatch: few, so that experts are often absent
DEFAULT_PLOT = os.path.join("out", "demo_loss.png")
_MAX_LOCAL_WORLD = 16  # processes on one machine, each with its own torch: beyond that, use torchrun
_TIMEOUT_S = 30.0  # collective timeout: a dead peer fails the demo in seconds instead of hanging it


@dataclass(frozen=True)
class Config:
    """The demo's settings, identical on every rank.

    Attributes:
        steps: optimizer steps.
        seed: seeds the model's initial values, the teacher and every step's global batch.
        counts: microbatches per rank per step (uneven by default); M = sum(counts).
    """

    steps: int
    seed: int
    counts: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.counts)

    @property
    def owner(self) -> int:
        """The declared owner of ``head_b``: the last rank, so that rank 0's copy is a stale replica."""
        return self.world_size - 1


@dataclass
class StepRecord:
    """One step, every approach: held-out loss before the step, max |grad - truth|, which parameters were off."""

    step: int
    loss: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    off: dict[str, list[str]] = field(default_factory=dict)  # parameters whose error exceeds the tolerance
    scale: float = 0.0  # the largest |entry| of gradagg's ground-truth gradient: what its error compares with


@dataclass
class Outcome:
    """What each rank hands back: the per-step records, the held-out loss after the last step, gradagg's ledger."""

    records: list[StepRecord]
    final_loss: dict[str, float]
    ledger: str  # gradagg's accumulation ledger of step 0, as text
    train_s: float = 0.0  # seconds spent training, start-up of the world excluded


# --- command line ------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (the ``gradagg demo`` subcommand)."""
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, teacher and data (default: 0)")
    parser.add_argument("--world-size", type=int, default=None, metavar="W",
                        help="local gloo processes to start (default: 2); under torchrun, the given world is used")
    parser.add_argument("--microbatches", metavar="M0,M1,...",
                        help="microbatches per rank per step, one per rank (default: 3, 5, 7, ...: uneven)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH",
                        help=f"where to write the PNG of loss and error curves, atomically (default: {DEFAULT_PLOT})")
    parser.add_argument("--quiet", action="store_true", help="print the summary only, not every step")


def run(args: argparse.Namespace) -> int:
    """Run the demo; return 0 if gradagg matched the full-batch gradient at every step, else 1.

    Raises:
        GradaggError: bad options (the CLI prints one line and exits 2), or a rank that failed.
    """
    given = _given_world()
    cfg = _config(args, given)
    if given is None or given[0] == 0:
        _prepare_plot_path(args.plot)  # before training, so that a bad path costs no wait
    start = time.perf_counter()
    rank, outcome = _run_in_given_world(cfg) if given else (0, _run_local(cfg))
    world_s = time.perf_counter() - start
    # Errors are all-reduced (max over ranks) inside the run, so every rank reaches the same verdict.
    ok = all(r.error[GRADAGG] <= TOLERANCE for r in outcome.records)
    if rank == 0:
        _print_outcome(cfg, outcome, quiet=args.quiet, where="the given world" if given else "127.0.0.1")
        _write_plot(args.plot, cfg, outcome)
        print(f"plot: {args.plot}")
        print(f"time: {time.perf_counter() - start:.1f} s (training {outcome.train_s:.1f} s; start-up "
              f"{world_s - outcome.train_s:.1f} s: torch imports, processes, gloo; output and plot "
              f"{time.perf_counter() - start - world_s:.1f} s)")
    return 0 if ok else 1


def _given_world() -> tuple[int, int] | None:
    """(rank, world size) of a world this process already belongs to, or None: then the demo starts one.

    A world is given by an initialised process group, or by torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR). torch is not imported for this: if it is not loaded, no group can be initialised.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise GradaggError(f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} "
                           "must be integers (they say this process is a rank of a torchrun world)") from None


def _config(args: argparse.Namespace, given: tuple[int, int] | None) -> Config:
    world = given[1] if given else (args.world_size or 2)
    if given and args.world_size not in (None, world):
        raise GradaggError(f"--world-size {args.world_size} given, but this process is in a world of {world} ranks")
    if world < 2:
        raise GradaggError(f"--world-size must be at least 2, got {world}: one rank has no replica and no uneven count")
    counts = _parse_counts(args.microbatches, world) if args.microbatches else tuple(3 + 2 * r for r in range(world))
    if given is None and world > _MAX_LOCAL_WORLD:
        raise GradaggError(f"--world-size {world}: at most {_MAX_LOCAL_WORLD} local processes (use torchrun for more)")
    if args.steps < 1:
        raise GradaggError(f"--steps must be at least 1, got {args.steps}")
    if not 0 <= args.seed < 2**32:
        raise GradaggError(f"--seed must be between 0 and 2**32 - 1, got {args.seed}")
    return Config(steps=args.steps, seed=args.seed, counts=counts)


def _prepare_plot_path(path: str) -> None:
    """Create the plot's folder; fail now, naming the path, if the PNG could not be written there."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise GradaggError(f"--plot {path}: cannot create the folder {directory}: {exc.strerror or exc}") from None
    if os.path.isdir(path):
        raise GradaggError(f"--plot {path}: is a folder; give a file name such as {os.path.join(path, 'demo.png')}")
    if not os.access(directory, os.W_OK):
        raise GradaggError(f"--plot {path}: the folder {directory} is not writable")


def _parse_counts(text: str, world: int) -> tuple[int, ...]:
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise GradaggError(f"--microbatches must be integers separated by commas, got {text!r}") from None
    if len(counts) != world:
        raise GradaggError(f"--microbatches gives {len(counts)} counts {list(counts)}, expected one per rank ({world})")
    if min(counts) < 1:
        # gradagg handles a rank with no microbatch; the DDP formula shown beside it would divide by zero.
        raise GradaggError(f"--microbatches: every rank needs at least 1 microbatch, got {list(counts)}")
    return counts


# --- starting the world ---------------------------------------------------------------


def _run_in_given_world(cfg: Config) -> tuple[int, Outcome]:
    """Train in the world this process is in: an initialised group as it is, else torchrun's (env://)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(seconds=_TIMEOUT_S))
    try:
        return dist.get_rank(), _train(cfg)
    except RuntimeError as exc:  # gloo's errors (a peer died, a timeout): one line, as the CLI wants
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CollectiveError(f"rank {dist.get_rank()}: {type(exc).__name__}: {first}") from None
    finally:
        if created:
            dist.destroy_process_group()


def _run_local(cfg: Config) -> Outcome:
    """Start W local gloo ranks on loopback (gradagg.torch's launcher) and return rank 0's outcome."""
    from gradagg.testing import launch_local_world

    outcomes = launch_local_world(_train, cfg.world_size, cfg, collective_timeout_s=_TIMEOUT_S, timeout_s=120.0)
    failed = [o for o in outcomes if not o.ok]
    if failed:  # one line per the CLI's rule: the last line of each failed rank's traceback
        raise CollectiveError("; ".join(f"rank {o.rank}: {_last_line(o.error)}" for o in failed))
    return outcomes[0].value  # type: ignore[no-any-return]


def _last_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "failed"


# --- model and data (torch from here on) ---------------------------------------------


def _init_params(seed: int) -> Params:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()

    params = {"router": draw(EXPERTS, DIM, scale=1.0)}
    for e in range(EXPERTS):
        params[f"expert{e}.weight"] = draw(DIM, DIM, scale=DIM**-0.5)
        params[f"expert{e}.bias"] = draw(DIM, scale=0.1)
    params["out"] = draw(DIM, scale=DIM**-0.5)
    params[HEAD] = draw(DIM, scale=0.1)
    return params


def _forward(p: Params, x: torch.Tensor, domain_b: bool) -> torch.Tensor:
    """Top-1 mixture of experts, then a linear read-out; domain B adds ``x . head_b``."""
    import torch

    gate, choice = torch.softmax(x @ p["router"].T, dim=-1).max(dim=-1)
    hidden = torch.zeros_like(x)
    for e in torch.unique(choice).tolist():  # an expert no token chose does not run: absent, not zero
        idx = (choice == e).nonzero().squeeze(1)
        hidden = hidden.index_copy(0, idx, torch.tanh(x[idx] @ p[f"expert{e}.weight"].T + p[f"expert{e}.bias"]))
    y = (gate.unsqueeze(1) * hidden) @ p["out"]  # the gate carries the router's gradient
    return y + x @ p[HEAD] if domain_b else y


def _loss(p: Params, mb: Microbatch) -> torch.Tensor:
    x, target, domain_b = mb
    return ((_forward(p, x, domain_b) - target) ** 2).mean()


def _global_batch(cfg: Config, step: int, repeat: int = 1) -> list[Microbatch]:
    """Every microbatch of one step, rank by rank; the same on every rank (seeded by seed and step).

    ``repeat`` multiplies every rank's count (a larger evaluation set of the same make-up).
    """
    import torch

    a, c = torch.randn(2, DIM, generator=_generator(cfg, _TEACHER), dtype=torch.float64)
    gen = _generator(cfg, step)
    batch: list[Microbatch] = []
    for rank, count in enumerate(cfg.counts):
        for _ in range(count * repeat):
            x = torch.randn(TOKENS, DIM, generator=gen, dtype=torch.float64)
            domain_b = rank == cfg.owner
            noise = 0.05 * torch.randn(TOKENS, generator=gen, dtype=torch.float64)
            batch.append((x, torch.sin(2 * x @ a) + (x @ c if domain_b else 0.0) + noise, domain_b))
    return batch


_TEACHER, _HELD_OUT = -2, -1  # random streams besides the steps' (0, 1, ...)


def _generator(cfg: Config, stream: int) -> torch.Generator:
    """A generator of its own for each stream of each seed: no two streams share numbers."""
    import torch

    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + stream + 2)


def _mine(cfg: Config, batch: list[Microbatch], rank: int) -> list[Microbatch]:
    start = sum(cfg.counts[:rank])
    return batch[start : start + cfg.counts[rank]]


def _held_out(cfg: Config) -> list[Microbatch]:
    """A fixed evaluation set, four steps' worth, as one microbatch per domain (two forwards, not 32)."""
    import torch

    batch = _global_batch(cfg, step=_HELD_OUT, repeat=4)
    return [(torch.cat([x for x, _, b in batch if b == domain]), torch.cat([y for _, y, b in batch if b == domain]),
             domain) for domain in (False, True)]


def _mean_loss(p: Params, sets: list[Microbatch]) -> float:
    """Mean squared error over every token of ``sets`` (weighted by their sizes)."""
    import torch

    with torch.no_grad():
        total = sum(float(_loss(p, mb)) * len(mb[1]) for mb in sets)
    return total / sum(len(mb[1]) for mb in sets)


def _ground_truth(p: Params, batch: list[Microbatch]) -> Params:
    """The gradient of (1/M) sum_i loss_i over the whole global batch, in this one process."""
    import torch

    total = torch.stack([_loss(p, mb) for mb in batch]).sum() / len(batch)
    grads = torch.autograd.grad(total, list(p.values()), allow_unused=True)
    return {n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(p.items(), grads)}


# --- one training run: every approach side by side ----------------------------------------


def _train(cfg: Config) -> Outcome:
    """Train one model copy per approach for ``cfg.steps`` steps; errors are the max over ranks."""
    import torch.distributed as dist

    # The demo's own plumbing (the mistakes, the error maxima) calls torch.distributed directly;
    # only the gradagg approach goes through gradagg.torch's public API.
    start = time.perf_counter()
    rank = dist.get_rank()
    if dist.get_world_size() != cfg.world_size:
        raise CollectiveError(f"rank {rank}: the group has {dist.get_world_size()} ranks, expected {cfg.world_size}")
    states = {name: _State(_init_params(cfg.seed)) for name in APPROACHES}  # the same start for all
    gradagg_step = _GradaggStep(states[GRADAGG].params, cfg, rank)
    held_out = _held_out(cfg)  # fixed, unlike the training batches: smooth loss curves
    records: list[StepRecord] = []
    ledger = ""
    for step in range(cfg.steps):
        batch = _global_batch(cfg, step)
        mine = _mine(cfg, batch, rank)
        rec = StepRecord(step)
        for name, st in states.items():
            rec.loss[name] = _mean_loss(st.params, held_out)
            truth = _ground_truth(st.params, batch)
            grads = gradagg_step(mine) if name == GRADAGG else _wrong_step(name, st, mine, cfg, rank)
            rec.error[name], rec.off[name] = _errors(grads, truth)
            if name == GRADAGG:  # the scale gradagg's error is measured against
                rec.scale = max(float(t.abs().max()) for t in truth.values())
            _sgd(st.params, grads)
        ledger = ledger or gradagg_step.acc.report()  # step 0's
        _max_over_ranks(rec)
        records.append(rec)
    gradagg_step.acc.close()
    final = {name: _mean_loss(st.params, held_out) for name, st in states.items()}
    return Outcome(records, final, ledger, time.perf_counter() - start)


@dataclass
class _State:
    """One approach's model copy, and its stale replica of head_b's gradient on a non-owner rank."""

    params: Params
    stale: torch.Tensor | None = None


class _GradaggStep:
    """The library path: MicrobatchAccumulator for the trunk, owner_reduce for head_b."""

    def __init__(self, params: Params, cfg: Config, rank: int) -> None:
        from gradagg.torch import MicrobatchAccumulator, Ownership

        self.params, self.owns_head = params, rank == cfg.owner
        # head_b stays out of the accumulator: only its owner computes it, so it travels through
        # owner_reduce, the distributed owner-sum; it is divided by the accumulator's counted M below.
        self.acc = MicrobatchAccumulator([(n, t) for n, t in params.items() if n != HEAD])
        self.ownership = Ownership.from_tensors({HEAD: params[HEAD]}, owners={HEAD: cfg.owner})

    def __call__(self, mine: list[Microbatch]) -> Params:
        import torch
        from gradagg.torch import owner_reduce

        head = self.params[HEAD]
        for name, t in self.params.items():
            if name != HEAD or self.owns_head:
                t.grad = None  # zero_grad; head_b only on its owner, so a replica keeps last step's
        for mb in mine:
            with self.acc.microbatch():
                _loss(self.params, mb).backward()  # type: ignore[no-untyped-call]  # unscaled: the accumulator divides
        ledger = self.acc.finish()
        if self.owns_head and head.grad is not None:
            if ledger.divisor is None:  # finish() always counts M; never guess a divisor
                raise WindowError("the accumulator finished without a microbatch count")
            head.grad.div_(ledger.divisor)  # the sum over the owner's microbatches -> its share of the mean
        held: dict[int | str, torch.Tensor] = {HEAD: head.grad} if head.grad is not None else {}  # stale: ignored
        head.grad = owner_reduce(held, self.ownership).get(HEAD)
        return {n: torch.zeros_like(t) if t.grad is None else t.grad for n, t in self.params.items()}


# --- the known wrong approaches ---------------------------------------------------------


@dataclass
class _Local:
    """What one rank knows after its microbatches: the raw material every approach combines."""

    sums: Params  # sum over this rank's microbatches; zeros where absent
    present: dict[str, int]  # participation: microbatches in which the parameter got a gradient
    count: int  # m_r, this rank's microbatches
    stale: torch.Tensor | None  # this rank's replica of head_b's gradient, if it does not own head_b


def _wrong_step(name: str, st: _State, mine: list[Microbatch], cfg: Config, rank: int) -> Params:
    """Combine the ranks' gradients the wrong way ``name`` does; each rank gets the same result."""
    import torch.distributed as dist

    import torch

    local = _local_sums(st.params, mine)
    local.stale = st.stale
    flat = _pack(local)
    flats = [torch.empty_like(flat) for _ in range(cfg.world_size)]
    dist.all_gather(flats, flat)  # every rank learns what every rank computed
    gathered = [_unpack(f, st.params) for f in flats]
    grads = _WRONG[name](gathered, cfg.owner)
    if rank != cfg.owner:
        st.stale = grads[HEAD].clone()  # what this replica holds until next step: it is never cleared
    return grads


def _local_sums(p: Params, mine: list[Microbatch]) -> _Local:
    import torch

    sums = {n: torch.zeros_like(t) for n, t in p.items()}
    present = dict.fromkeys(p, 0)
    for mb in mine:
        grads = torch.autograd.grad(_loss(p, mb), list(p.values()), allow_unused=True)  # None = absent
        for n, g in zip(p, grads):
            if g is not None:
                sums[n] += g
                present[n] += 1
    return _Local(sums, present, len(mine), None)


def _pack(local: _Local) -> torch.Tensor:
    """One flat float64 tensor: sums | participation | m_r | has a stale copy | stale copy (or zeros).

    A tensor all_gather, not all_gather_object: pickling tensors cost more than the whole training.
    """
    import torch

    stale = local.stale if local.stale is not None else torch.zeros_like(local.sums[HEAD])
    counts = [*local.present.values(), local.count, float(local.stale is not None)]
    return torch.cat([*(t.reshape(-1) for t in local.sums.values()), torch.tensor(counts, dtype=torch.float64),
                      stale.reshape(-1)])


def _unpack(flat: torch.Tensor, like: Params) -> _Local:
    sums, pos = {}, 0
    for n, t in like.items():
        sums[n] = flat[pos : pos + t.numel()].view(t.shape)
        pos += t.numel()
    counts = [round(v) for v in flat[pos : pos + len(like) + 2].tolist()]  # whole numbers, exact in float64
    stale = flat[pos + len(like) + 2 :].view(like[HEAD].shape) if counts[-1] else None
    return _Local(sums, dict(zip(like, counts)), counts[len(like)], stale)


def _exact(ls: list[_Local]) -> Params:
    """The right mean, sum / M, used by the replica mistakes for everything but head_b."""
    m = sum(loc.count for loc in ls)
    return {n: sum((loc.sums[n] for loc in ls[1:]), ls[0].sums[n]) / m for n in ls[0].sums}


def _by_participation(ls: list[_Local], owner: int) -> Params:
    # mutants.divide_by_participation: right for parameters present everywhere, too big for the rest.
    return {n: sum((loc.sums[n] for loc in ls[1:]), ls[0].sums[n]) / max(1, sum(loc.present[n] for loc in ls))
            for n in ls[0].sums}


def _ddp(ls: list[_Local], owner: int) -> Params:
    # Each rank's (loss / m_r).backward(), then DDP's all_reduce and division by the world size W.
    return {n: sum((loc.sums[n] / loc.count for loc in ls[1:]), ls[0].sums[n] / ls[0].count) / len(ls)
            for n in ls[0].sums}


def _head_copies(ls: list[_Local], owner: int, fresh: torch.Tensor) -> list[torch.Tensor]:
    """head_b's copy on each rank, in rank order: fresh on the owner, stale (or none yet) elsewhere."""
    copies = [fresh if r == owner else loc.stale for r, loc in enumerate(ls)]
    return [c for c in copies if c is not None]


def _sum_every_replica(ls: list[_Local], owner: int) -> Params:
    grads = _exact(ls)  # mutants.sum_every_replica
    copies = _head_copies(ls, owner, grads[HEAD])
    grads[HEAD] = sum(copies[1:], copies[0])
    return grads


def _first_replica(ls: list[_Local], owner: int) -> Params:
    grads = _exact(ls)  # mutants.first_replica: rank 0's copy is a stale replica
    grads[HEAD] = _head_copies(ls, owner, grads[HEAD])[0]
    return grads


_WRONG: dict[str, Callable[[list[_Local], int], Params]] = {
    APPROACHES[1]: _by_participation,
    APPROACHES[2]: _ddp,
    APPROACHES[3]: _sum_every_replica,
    APPROACHES[4]: _first_replica,
}


# --- measuring and stepping ----------------------------------------------------------------


def _errors(grads: Params, truth: Params) -> tuple[float, list[str]]:
    """The max |grad - truth| over every parameter, and the parameters beyond the tolerance."""
    errors = {n: float((grads[n] - truth[n]).abs().max()) for n in truth}
    return max(errors.values()), [n for n, e in errors.items() if e > TOLERANCE]


def _sgd(p: Params, grads: Params) -> None:
    import torch

    with torch.no_grad():
        for n, t in p.items():
            t.sub_(LR * grads[n])


def _max_over_ranks(rec: StepRecord) -> None:
    """Replace each error by its maximum over ranks, so that rank 0 reports every rank's worst."""
    import torch.distributed as dist

    import torch

    errors = torch.tensor([rec.error[a] for a in APPROACHES], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    rec.error = dict(zip(APPROACHES, errors.tolist()))


# --- output ----------------------------------------------------------------------------------

_SHORT = {GRADAGG: "gradagg", APPROACHES[1]: "particip.", APPROACHES[2]: "DDP W*m_r",
          APPROACHES[3]: "sum repl.", APPROACHES[4]: "first repl."}


def _print_outcome(cfg: Config, outcome: Outcome, *, quiet: bool, where: str) -> None:
    m = sum(cfg.counts)
    print(f"gradagg demo: {cfg.world_size} gloo processes on {where}; microbatches per rank {list(cfg.counts)}, "
          f"M = {m}; float64; seed {cfg.seed}; {cfg.steps} steps")
    print(f"model: top-1 mixture of {EXPERTS} experts, {TOKENS} tokens per microbatch (an expert no token chose is "
          f"absent there);\n       {HEAD} replicated on every rank, owned by rank {cfg.owner}, used by its data only")
    print("ground truth: the gradient of (1/M) sum_i loss_i over the whole global batch, in one process, every step")
    if not quiet:
        print(f"\ngradagg's ledger after step 0 (rank 0; {HEAD} is not in it: it goes through owner_reduce)")
        print(outcome.ledger)
        _print_steps(outcome.records)
    _print_summary(outcome)


def _print_steps(records: list[StepRecord]) -> None:
    print("\nmax |gradient - ground truth| over all parameters and ranks (each approach trains its own copy)")
    print(f"{'step':>4}  {'loss':>8}  " + "  ".join(f"{_SHORT[a]:>11}" for a in APPROACHES))
    for r in records:
        print(f"{r.step:>4}  {r.loss[GRADAGG]:>8.5f}  " + "  ".join(f"{r.error[a]:>11.1e}" for a in APPROACHES))
    print("(loss: gradagg's held-out loss before the step)")


def _print_summary(outcome: Outcome) -> None:
    records = outcome.records
    scale = max(r.scale for r in records)
    print(f"\nsummary over {len(records)} steps; tolerance {TOLERANCE:.0e}: in float64, sums of M terms added in "
          f"another order differ\nby ~M * 2.2e-16 * |g|, and gradagg's gradient entries are |g| <= {scale:.2g} here")
    print(f"{'approach':<23}  {'max error':>9}  {'verdict':<7}  {'final loss':>10}  parameters off (at any step)")
    for a in APPROACHES:
        error = max(r.error[a] for r in records)
        off = _groups(sorted({n for r in records for n in r.off[a]})) or "none"
        verdict = "exact" if error <= TOLERANCE else "WRONG"
        print(f"{a:<23}  {error:>9.1e}  {verdict:<7}  {outcome.final_loss[a]:>10.5f}  {off}")
    print(f"(step 0 has no stale {HEAD} replica yet, so the two replica mistakes happen to be right there)")
    ok = all(r.error[GRADAGG] <= TOLERANCE for r in records)
    print("gradagg " + ("matched" if ok else "DID NOT match") + f" the full-batch gradient within {TOLERANCE:.0e} "
          + ("at every step" if ok else "at some step"))


def _groups(names: list[str]) -> str:
    """``['expert0.bias', 'expert2.weight', 'head_b']`` -> ``'experts 0,2; head_b'``."""
    experts = sorted({n.split(".")[0].removeprefix("expert") for n in names if n.startswith("expert")})
    others = [n for n in names if not n.startswith("expert")]
    return "; ".join(([f"experts {','.join(experts)}"] if experts else []) + others)


def _write_plot(path: str, cfg: Config, outcome: Outcome) -> None:
    """Loss curves (left) and gradient errors on a log scale (right), written atomically as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from gradagg.formats.atomic import atomic_path

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot's global state
    loss_ax, err_ax = fig.subplots(1, 2)
    records = outcome.records
    steps = [r.step for r in records]
    for a in APPROACHES:
        style = {"color": "black", "linewidth": 2.5, "zorder": 3} if a == GRADAGG else {"linestyle": "--"}
        losses = [r.loss[a] for r in records] + [outcome.final_loss[a]]  # before each step, then after the last
        loss_ax.plot([*steps, len(steps)], losses, label=a, **style)  # type: ignore[arg-type]
        # An exact 0 has no place on a log axis: draw it at 1e-18, below anything float64 round-off makes.
        err_ax.plot(steps, [max(r.error[a], 1e-18) for r in records], label=a, **style)  # type: ignore[arg-type]
    err_ax.axhline(TOLERANCE, color="grey", linewidth=1, linestyle=":", label=f"tolerance {TOLERANCE:.0e}")
    # Log scales: a diverging run and round-off (1e-16) share the axes with everything in between.
    loss_ax.set(title="held-out loss, each approach training its own copy", xlabel="step", yscale="log")
    err_ax.set(title="max |gradient - full-batch gradient|, all ranks", xlabel="step", yscale="log")
    for ax in (loss_ax, err_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    err_ax.legend(fontsize=8, loc="center right")
    fig.suptitle(f"gradagg demo: {cfg.world_size} ranks, microbatches per rank {list(cfg.counts)}, float64")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)  # the temporary name has no .png: say the format
