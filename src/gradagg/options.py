"""Option values shared by every entry point, each with its one check (standard library only).

The command line offers these values as ``choices``; the reference, the engine
and the training code call the checks. A value is defined here and nowhere
else, so the entry points cannot drift apart.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

from gradagg.errors import GradaggError

NonFinite: TypeAlias = Literal["propagate", "raise"]
NONFINITE: tuple[str, ...] = ("propagate", "raise")
"""``"propagate"``: NaN and Inf are values and flow into the result; ``"raise"``: a counted one is an error."""

Format: TypeAlias = Literal["json", "jsonl", "csv", "parquet"]
FORMATS: tuple[str, ...] = ("json", "jsonl", "csv", "parquet")
"""Input formats of the command line: JSON, JSON Lines and CSV (:mod:`gradagg.rows.formats.text`), Parquet."""
EXTENSIONS: dict[str, str] = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                              ".parquet": "parquet"}
"""The formats by extension (lower case), in and out: :mod:`gradagg.rows.formats.detect`'s one table."""

Contract: TypeAlias = Literal["owner-sum", "microbatch-mean"]
CONTRACTS: tuple[Contract, ...] = ("owner-sum", "microbatch-mean")
"""The two contracts, by the names ``gradagg verify --contract`` and :mod:`gradagg.verify` use."""

Engine: TypeAlias = Literal["auto", "python", "numpy", "numba", "torch"]
ENGINES: tuple[str, ...] = ("auto", "python", "numpy", "numba", "torch")
"""``"auto"`` lets :mod:`gradagg.rows.engine` choose by the input's kind; the others name a backend."""


def check_nonfinite(nonfinite: object) -> NonFinite:
    """Return ``nonfinite`` if it is one of :data:`NONFINITE`, else raise naming the value.

    >>> check_nonfinite("raise")
    'raise'
    >>> check_nonfinite("ignore")
    Traceback (most recent call last):
    ...
    gradagg.errors.GradaggError: nonfinite must be 'propagate' or 'raise', got 'ignore'
    """
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE:
        raise GradaggError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")
    return nonfinite  # type: ignore[return-value]


def check_engine(engine: object) -> Engine:
    """Return ``engine`` if it is one of :data:`ENGINES`, else raise naming the value.

    >>> check_engine("numpy")
    'numpy'
    """
    if not isinstance(engine, str) or engine not in ENGINES:
        raise GradaggError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    return engine  # type: ignore[return-value]


def install_hint(extra: str) -> str:
    """How to install an extra: from a clone of the repository, since gradagg is not published on PyPI.

    >>> install_hint("rows")
    "pip install -e '.[rows]' in a clone of gradagg (it is not on PyPI)"
    """
    return f"pip install -e '.[{extra}]' in a clone of gradagg (it is not on PyPI)"
