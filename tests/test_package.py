"""Packaging promises: a light import, type information, and a README whose example runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gradagg

ROOT = Path(__file__).resolve().parent.parent


def test_import_gradagg_loads_no_heavy_framework() -> None:
    """`import gradagg` (and the CLI module) must not pull in numpy, torch, pyarrow or pandas."""
    code = (
        "import sys, gradagg, gradagg.cli; "
        "print(sorted(m for m in ('numpy', 'torch', 'pyarrow', 'pandas', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_integrations_package_imports_no_framework() -> None:
    """`import gradagg.integrations` imports no training framework: each module imports its own when used."""
    heavy = ("torch", "transformers", "accelerate", "lightning", "pytorch_lightning", "trl", "torchtitan", "torchft")
    code = f"import sys, gradagg.integrations; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_imports_no_engine_code() -> None:
    """`gradagg --help` (and each subcommand's) parses only: neither the engine nor any backend is imported."""
    code = (
        "import sys, contextlib, io\n"
        "from gradagg.cli import main\n"
        "for args in (['--help'], ['owner-sum', '--help'], ['mean', '--help'], ['verify', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(args)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('gradagg.rows', 'numpy', 'pyarrow'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_py_typed_is_shipped() -> None:
    assert (Path(gradagg.__file__).parent / "py.typed").exists()


def test_dir_lists_the_api_only() -> None:
    """Issue 25: `dir(gradagg)` showed `Any` and `annotations`; it lists `__all__` and `__version__`, nothing else."""
    assert dir(gradagg) == sorted([*gradagg.__all__, "__version__"])
    assert {"owner_sum", "microbatch_mean", "GradaggError"} <= set(dir(gradagg))
