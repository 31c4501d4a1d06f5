"""The demo's options and its :class:`Config`: parsed and checked here, before any process starts (no torch)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from gradagg.errors import GradaggError

CASES = ("tokens", "moe")
"""``tokens``: token-weighted language model; ``moe``: mixture of experts with a replicated, owned parameter."""
WRAPS = ("none", "ddp", "fsdp")
"""How gradagg's model copy is wrapped: a plain module, ``DistributedDataParallel``, or FSDP2 ``fully_shard``."""
WRAP_NAMES = {"none": "a plain module", "ddp": "DistributedDataParallel", "fsdp": "FSDP2 (fully_shard, sharded grads)"}
"""What each ``--wrap`` value is, in words, for the report and the plot's title."""
DEFAULT_PLOT = os.path.join("out", "demo_loss.png")
MAX_LOCAL_WORLD = 16  # processes on one machine, each with its own torch: beyond that, use torchrun


@dataclass(frozen=True)
class Config:
    """The demo's settings, identical on every rank.

    Attributes:
        steps: optimizer steps.
        seed: seeds the models' initial values, the teachers and every step's global batch.
        counts: microbatches per rank per step (uneven by default); M = sum(counts).
        cases: the cases to run, from :data:`CASES`, in that order.
        wrap: how gradagg's model is wrapped, from :data:`WRAPS`.

    >>> cfg = Config(steps=2, seed=0, counts=(3, 5), cases=("tokens",), wrap="none")
    >>> cfg.world_size, cfg.owner, cfg.m
    (2, 1, 8)
    """

    steps: int
    seed: int
    counts: tuple[int, ...]
    cases: tuple[str, ...] = CASES
    wrap: str = "none"

    @property
    def world_size(self) -> int:
        """W, the number of ranks."""
        return len(self.counts)

    @property
    def owner(self) -> int:
        """The declared owner of the MoE's ``head_b``: the last rank, so that rank 0's copy is a stale replica."""
        return self.world_size - 1

    @property
    def m(self) -> int:
        """M, the microbatches of one step on all ranks."""
        return sum(self.counts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (the ``gradagg demo`` subcommand).

    Args:
        parser: the subcommand's parser.

    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> p.parse_args(["--case", "tokens", "--wrap", "fsdp"]).wrap
    'fsdp'
    """
    parser.add_argument("--case", choices=(*CASES, "all"), default="all",
                        help="tokens: token-weighted LM; moe: experts and an owned replica; all (default): both")
    parser.add_argument("--wrap", choices=WRAPS, default="none",
                        help="gradagg's model: plain (default), DistributedDataParallel, or FSDP2 fully_shard")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the models, teachers and data (default: 0)")
    parser.add_argument("--world-size", type=int, default=None, metavar="W",
                        help="local gloo processes to start (default: 2); under torchrun, the given world is used")
    parser.add_argument("--microbatches", metavar="M0,M1,...",
                        help="microbatches per rank per step, one per rank (default: 3, 5, 7, ...: uneven)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH",
                        help=f"where to write the PNG of loss and error curves, atomically (default: {DEFAULT_PLOT})")
    parser.add_argument("--quiet", action="store_true", help="print the summaries only, not every step")


def config(args: argparse.Namespace, given: tuple[int, int] | None) -> Config:
    """Check the options and build the :class:`Config`.

    Args:
        args: the parsed options.
        given: (rank, world size) of a world this process is already in, or None.

    Returns:
        The configuration, the same on every rank.

    Raises:
        GradaggError: an option out of range, naming it and its value.

    >>> ns = argparse.Namespace(case="moe", wrap="ddp", steps=3, seed=1, world_size=None, microbatches="2,4")
    >>> config(ns, None).counts
    (2, 4)
    """
    world = given[1] if given else (2 if args.world_size is None else args.world_size)
    if given and args.world_size not in (None, world):
        raise GradaggError(f"--world-size {args.world_size} given, but this process is in a world of {world} ranks")
    if world < 2:
        raise GradaggError(f"--world-size must be at least 2, got {world}: one rank has no replica and no uneven count")
    if given is None and world > MAX_LOCAL_WORLD:
        raise GradaggError(f"--world-size {world}: at most {MAX_LOCAL_WORLD} local processes (use torchrun for more)")
    counts = parse_counts(args.microbatches, world) if args.microbatches else tuple(3 + 2 * r for r in range(world))
    if args.steps < 1:
        raise GradaggError(f"--steps must be at least 1, got {args.steps}")
    if not 0 <= args.seed < 2**32:
        raise GradaggError(f"--seed must be between 0 and 2**32 - 1, got {args.seed}")
    cases = CASES if args.case == "all" else (args.case,)
    return Config(steps=args.steps, seed=args.seed, counts=counts, cases=cases, wrap=args.wrap)


def parse_counts(text: str, world: int) -> tuple[int, ...]:
    """``"3,5"`` -> ``(3, 5)``: one count per rank, each at least 1.

    Args:
        text: the ``--microbatches`` value.
        world: the number of ranks.

    Returns:
        The counts.

    Raises:
        GradaggError: not integers, not one per rank, or a count below 1.

    >>> parse_counts("3, 5", 2)
    (3, 5)
    """
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise GradaggError(f"--microbatches must be integers separated by commas, got {text!r}") from None
    if len(counts) != world:
        raise GradaggError(f"--microbatches gives {len(counts)} counts {list(counts)}, expected one per rank ({world})")
    if min(counts) < 1:
        # gradagg handles a rank with no microbatch; the per-rank means shown beside it would divide by zero.
        raise GradaggError(f"--microbatches: every rank needs at least 1 microbatch, got {list(counts)}")
    return counts


def prepare_plot_path(path: str) -> None:
    """Create the plot's folder; fail now, naming the path, if the PNG could not be written there.

    Args:
        path: the ``--plot`` value.

    Raises:
        GradaggError: the folder cannot be created or written, or ``path`` is a folder.

    >>> import tempfile
    >>> prepare_plot_path(tempfile.mkdtemp())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    gradagg.errors.GradaggError: --plot ...: is a folder; give a file name such as .../demo.png
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise GradaggError(f"--plot {path}: cannot create the folder {directory}: {exc.strerror or exc}") from None
    if os.path.isdir(path):
        raise GradaggError(f"--plot {path}: is a folder; give a file name such as {os.path.join(path, 'demo.png')}")
    if not os.access(directory, os.W_OK):
        raise GradaggError(f"--plot {path}: the folder {directory} is not writable")
