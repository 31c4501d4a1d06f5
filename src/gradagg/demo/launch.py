"""Where the demo trains: the world this process was given (torchrun, or a group already initialised), or a
local one started here on loopback (:mod:`gradagg.testing`). torch is imported only when a world is used.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from gradagg.errors import CollectiveError, GradaggError, first_line, last_line

if TYPE_CHECKING:
    from gradagg.demo.options import Config
    from gradagg.demo.results import Outcome

TIMEOUT_S = 30.0  # collective timeout: a dead peer fails the demo in seconds instead of hanging it
START_S = 120.0  # the whole local world, start-up included
# Modules the ranks would otherwise each import on first use (DDP imports torch._dynamo, a slow import).
_PRELOAD = {"none": [], "ddp": ["torch._dynamo"], "fsdp": ["torch.distributed.fsdp", "torch.distributed.tensor"]}


def given_world() -> tuple[int, int] | None:
    """(rank, world size) of a world this process already belongs to, or None: then the demo starts one.

    A world is given by an initialised process group, or by torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR). torch is not imported for this: if it is not loaded, no group can be initialised.

    Returns:
        (rank, world size), or None.

    Raises:
        GradaggError: RANK or WORLD_SIZE is set but not an integer.

    >>> given_world() is None or isinstance(given_world(), tuple)
    True
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


def run_in_given_world(cfg: Config) -> tuple[int, Outcome]:
    """Train in the world this process is in: an initialised group as it is, else torchrun's (env://).

    Args:
        cfg: the configuration.

    Returns:
        (this rank, what it trained and measured).

    Raises:
        CollectiveError: a collective failed (a peer died, a timeout), in one line.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from gradagg.demo.train import train

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    try:
        return dist.get_rank(), train(cfg)
    except RuntimeError as exc:  # gloo's errors: one line, as the CLI wants
        raise CollectiveError(f"rank {dist.get_rank()}: {type(exc).__name__}: {first_line(exc)}") from None
    finally:
        if created:
            dist.destroy_process_group()


def run_local(cfg: Config) -> Outcome:
    """Start W local gloo ranks on loopback and return rank 0's outcome.

    Args:
        cfg: the configuration.

    Returns:
        Rank 0's outcome (every rank's errors are already maxima over ranks).

    Raises:
        CollectiveError: a rank failed; one line per failed rank, the last line of its traceback.
    """
    from gradagg.demo.train import train
    from gradagg.testing import launch_local_world

    outcomes = launch_local_world(train, cfg.world_size, cfg, collective_timeout_s=TIMEOUT_S, timeout_s=START_S,
                                  preload=_PRELOAD[cfg.wrap])
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise CollectiveError("; ".join(f"rank {o.rank}: {last_line(o.error)}" for o in failed))
    return outcomes[0].value  # type: ignore[no-any-return]
