"""The handlers the parser names: ``verify`` here; ``owner-sum`` and ``mean`` in :mod:`gradagg.rows.commands`.

The file commands run only where the ``rows`` extra (NumPy, pyarrow) is
installed; without it they end with one line naming the install, exit 2,
before anything is read. The check finds the packages without importing them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from gradagg.errors import GradaggError
from gradagg.options import CONTRACTS, install_hint

EXIT_OK, EXIT_FAILED = 0, 1
ROWS_PACKAGES = ("numpy", "pyarrow")  # what the file commands import (orjson is optional: json writes without it)


def owner_sum(args: argparse.Namespace) -> int:
    """``gradagg owner-sum``: :func:`gradagg.rows.commands.owner_sum`, where the rows extra is installed."""
    _need_rows(args.command)
    from gradagg.rows import commands

    return commands.owner_sum(args)


def mean(args: argparse.Namespace) -> int:
    """``gradagg mean``: :func:`gradagg.rows.commands.mean`, where the rows extra is installed."""
    _need_rows(args.command)
    from gradagg.rows import commands

    return commands.mean(args)


def _need_rows(command: str) -> None:
    """Refuse a file command in one line where a package of the rows extra is missing (or blocked)."""
    missing = [name for name in ROWS_PACKAGES if not _importable(name)]
    if missing:
        raise GradaggError(f"gradagg {command} needs {' and '.join(missing)} (the rows extra), which "
                           f"{'is' if len(missing) == 1 else 'are'} not installed here; install it with: "
                           f"{install_hint('rows')}")


def _importable(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it (None in ``sys.modules`` cannot be)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def verify(args: argparse.Namespace) -> int:
    """``gradagg verify``: the contract checks, on the built-in implementation or on ``--impl``."""
    from gradagg.verify import run_checks, run_checks_isolated

    if args.impl is not None and args.contract == "all":
        raise GradaggError("--impl checks one contract: add --contract owner-sum or --contract microbatch-mean")
    contracts = CONTRACTS if args.contract == "all" else (args.contract,)
    observations: list[dict[str, Any]] = []
    for contract in contracts:
        if args.impl is None:
            report = run_checks(contract)
        else:
            report, printed = run_checks_isolated(contract, args.impl, timeout=args.timeout)
            sys.stderr.write(printed if printed.endswith("\n") or not printed else printed + "\n")
        for obs in report["observations"]:
            label = obs["check"] if len(contracts) == 1 else f"{contract}: {obs['check']}"
            observations.append({**obs, "check": label})
    passed = all(o["passed"] for o in observations)
    print(json.dumps({"observations": observations, "passed": passed}))
    return EXIT_OK if passed else EXIT_FAILED
