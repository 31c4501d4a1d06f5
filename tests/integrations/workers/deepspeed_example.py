"""Run an example script the way ``torchrun`` would, with DeepSpeed's shared-memory op marked unbuildable first.

``torchrun ... -m tests.integrations.workers.deepspeed_example examples/deepspeed_exact.py 2``: the example's own code,
as a user runs it, except that DeepSpeed does not JIT-compile ``deepspeed_shm_comm`` at its first
``init_distributed`` (minutes on 2 cores in a fresh environment, for an op ZeRO does not use: see
:func:`~tests.integrations.workers.deepspeed_zero.no_shared_memory_op`).
"""

from __future__ import annotations

import runpy
import sys

from tests.integrations.workers.deepspeed_zero import no_shared_memory_op

if __name__ == "__main__":
    script, *args = sys.argv[1:]
    no_shared_memory_op()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
