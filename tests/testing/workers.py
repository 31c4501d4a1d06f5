"""Workers for tests/testing: module-level, so that each rank can import them by name."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def cwd_and_pid() -> tuple[str, int]:
    return os.getcwd(), os.getpid()


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def leaves_a_child() -> int:
    """Start a process that would outlive this rank (it holds the rank's stdout), and return its pid."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]).pid


def has_a_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def preloaded(names: list[str]) -> list[bool]:
    """Which of ``names`` this rank has without importing anything (forked from the server with them)."""
    import sys

    return [n in sys.modules for n in names]
