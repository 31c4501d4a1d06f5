"""Run an example script the way ``torchrun`` would, failing at once if DeepSpeed starts compiling its shared-memory op.

``torchrun ... -m tests.integrations.workers.deepspeed_example examples/deepspeed_exact.py 2``: the example's own code,
as a user runs it. The example must keep DeepSpeed from JIT-compiling ``deepspeed_shm_comm`` at its first
``init_distributed`` itself (minutes on 2 cores in a fresh environment, for an op ZeRO does not use: see
:func:`~tests.integrations.workers.deepspeed_zero.no_shared_memory_op`); here a compile it let through raises at once,
naming this, rather than running for minutes and timing out.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any


def refuse_compiling_the_shared_memory_op() -> None:
    """Make the shared-memory op's builder raise when DeepSpeed would compile it (its ``load``: test-only, on the
    builder class DeepSpeed's accelerator returns)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:  # an accelerator without the op: nothing to compile
        return

    def load(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the example let DeepSpeed compile its shared-memory op (deepspeed_shm_comm): mark it "
                           "unbuildable before deepspeed.init_distributed, as examples/deepspeed_exact.py's "
                           "no_shared_memory_op does")

    type(builder).load = load


if __name__ == "__main__":
    script, *args = sys.argv[1:]
    refuse_compiling_the_shared_memory_op()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
