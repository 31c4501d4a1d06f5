"""``import gradagg.torch`` without torch: an ImportError that says what to install (checked with torch hidden)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"  # `import torch` now raises ModuleNotFoundError('torch')


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-c", HIDE_TORCH + code]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def test_missing_torch_names_the_extra_and_the_cpu_build() -> None:
    """The error is an ImportError (not a bare ModuleNotFoundError) naming the extra, the CUDA build it pulls on
    Linux, and the CPU index URL; `import gradagg` itself still works."""
    code = (
        "import gradagg\n"
        "try:\n    import gradagg.torch\n"
        "except ImportError as e:\n    print(type(e).__name__); print(e)\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    kind, message = proc.stdout.split("\n", 1)
    assert kind == "ImportError", proc.stdout
    for fragment in ("pip install -e '.[torch]' in a clone of gradagg", "CUDA", "https://download.pytorch.org/whl/cpu"):
        assert fragment in message, (fragment, message)
