"""``gradagg demo``: distributed training, checked every step against the single-process full-batch gradient.

What the demo shows
-------------------
Small float64 models train on W gloo processes (2 by default, started here on loopback; under
``torchrun``, the world it was given). Ranks run uneven numbers of microbatches per step (3 and 5 by
default; M in all). Every step, every rank also computes alone the gradient of the whole global batch:
the ground truth. The demo prints how far each way of combining the ranks' gradients lands from it, in
two cases (``--case``):

* **tokens**: a language model on padded sequences of uneven lengths (padding targets ``-100``,
  ``cross_entropy(..., ignore_index=-100, reduction="sum")``). The truth is the gradient of the
  cross-entropy averaged over every valid token of the global batch. gradagg: each microbatch with
  ``weight=`` its valid tokens, D = all the valid tokens of all ranks. Wrong: the mean of per-microbatch
  token means; each rank's own token count times the world size; dividing by M.
* **moe**: a top-1 mixture of experts (an expert no token of a microbatch chose is *absent* there) and a
  parameter ``head_b`` replicated on every rank and owned by the last one. gradagg: the accumulator
  (D = M) and ``owner_reduce``. Wrong: divide by participation; DDP's per-rank means (W x m_r); sum
  every replica; take the first replica.

``--wrap ddp`` or ``--wrap fsdp`` wraps gradagg's model copy in ``DistributedDataParallel`` or shards
it with FSDP2's ``fully_shard`` (gradients become DTensors): gradagg stays exact either way. Each
approach trains its own copy from the same start (plain SGD), so the plot (``--plot``) shows what each
error does to the loss, beside the error itself. Exit status 0 when gradagg's error stayed within the
tolerance at every step of every case, 1 otherwise: the demo is itself a check.

Modules: :mod:`~gradagg.demo.options` (options, config), :mod:`~gradagg.demo.launch` (which world),
:mod:`~gradagg.demo.models` and :mod:`~gradagg.demo.data`, :mod:`~gradagg.demo.wrap` (``--wrap``),
:mod:`~gradagg.demo.approaches` (gradagg and the wrong approaches), :mod:`~gradagg.demo.cases`,
:mod:`~gradagg.demo.train` (the side-by-side loop), :mod:`~gradagg.demo.results` (what the ranks hand
back), :mod:`~gradagg.demo.report` and :mod:`~gradagg.demo.plot`. Importing this package loads neither
torch nor matplotlib: they load when the demo runs.
"""

from __future__ import annotations

import argparse
import time

from gradagg.demo import launch, options, results
from gradagg.demo.options import add_arguments
from gradagg.errors import require_torch


def run(args: argparse.Namespace) -> int:
    """Run the demo; return 0 if gradagg matched the full-batch gradient at every step, else 1.

    Args:
        args: the options of :func:`add_arguments`.

    Returns:
        The exit status: 0 or 1. Every rank of a given world returns the same one.

    Raises:
        GradaggError: torch is not installed, bad options (the CLI prints one line and exits 2), or a rank
            that failed.

    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> run(p.parse_args(["--steps", "0"]))
    Traceback (most recent call last):
    gradagg.errors.GradaggError: --steps must be at least 1, got 0
    """
    from gradagg.demo.report import print_outcome

    given = launch.given_world()
    cfg = options.config(args, given)
    require_torch("gradagg demo")
    leader = given is None or given[0] == 0
    plotting = leader and plot_available()
    if plotting:
        options.prepare_plot_path(args.plot)  # before training, so that a bad path costs no wait
    start = time.perf_counter()
    rank, outcome = demonstrate(cfg, given)
    world_s = time.perf_counter() - start
    # Errors are all-reduced (max over ranks) inside the run, so every rank reaches the same verdict.
    if rank == 0:
        where = "the given world" if given else "127.0.0.1"
        print_outcome(outcome, cfg.counts, cfg.seed, cfg.steps, quiet=args.quiet, where=where)
        _plot(args.plot, outcome, cfg.counts, plotting)
        print(f"time: {time.perf_counter() - start:.1f} s (training {outcome.train_s:.1f} s; start-up "
              f"{world_s - outcome.train_s:.1f} s: torch imports, processes, gloo; output and plot "
              f"{time.perf_counter() - start - world_s:.1f} s)")
    return 0 if results.passed(outcome) else 1


def demonstrate(cfg: options.Config, given: tuple[int, int] | None = None) -> tuple[int, results.Outcome]:
    """Train every case of ``cfg`` in the given world, or in a new local one; print nothing.

    Args:
        cfg: the configuration (see :func:`gradagg.demo.options.config`).
        given: (rank, world size) of a world this process is already in, or None to start one.

    Returns:
        ``(this rank, its outcome)``: the per-step errors and losses of every approach, maxima over ranks.
    """
    return launch.run_in_given_world(cfg) if given else (0, launch.run_local(cfg))


def plot_available() -> bool:
    """Whether matplotlib can be imported (the plot is skipped, saying so, when it cannot)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plot(path: str, outcome: results.Outcome, counts: tuple[int, ...], plotting: bool) -> None:
    if not plotting:
        print("plot: skipped: matplotlib is not installed (pip install matplotlib)")
        return
    from gradagg.demo.plot import write_plot

    write_plot(path, outcome, counts)
    print(f"plot: {path}")


__all__ = ["add_arguments", "demonstrate", "run"]
