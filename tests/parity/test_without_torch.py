"""``gradagg parity`` on a machine without torch: what can be checked without it is checked first.

Each run is the whole command line in a process where ``import torch`` fails (``sys.modules["torch"] = None``),
as on a machine with gradagg installed without its torch extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "scripts"


def _parity_without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    code = ("import sys; sys.modules['torch'] = None; from gradagg.cli import main; "
            "sys.exit(main(['parity', *sys.argv[1:]]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("script", "message"), [
    ("nosuch.py", "nosuch.py: no such file"),
    (str(FIXTURES), "is a folder, not a script"),
])
def test_a_missing_script_is_named_before_torch_is_needed(script: str, message: str) -> None:
    proc = _parity_without_torch(script)
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("gradagg: error: ") and message in proc.stderr, proc.stderr


def test_an_existing_script_without_torch_says_it_needs_torch() -> None:
    proc = _parity_without_torch(str(FIXTURES / "right.py"))
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "gradagg parity needs torch: pip install -e '.[torch]' in a clone of gradagg" in proc.stderr, proc.stderr
