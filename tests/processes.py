"""What the tests that end process sessions check: that a process is gone."""

from __future__ import annotations

import time
from pathlib import Path


def gone(pid: int, *, tries: int = 100) -> bool:
    """No such process, or a zombie waiting for a parent to reap it (it runs nothing any more).

    SIGKILL is delivered asynchronously, so this looks ``tries`` times, 20 ms apart.
    """
    for _ in range(tries):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False
