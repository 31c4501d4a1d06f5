"""The CSV number rule (``_csv.NUMBER``, one regular expression) against a literal reading of the grammar.

The grammar (:mod:`gradagg.rows.formats.text`): an ASCII decimal (``1``, ``-2.5``, ``1e-3``, ``.5``), or ``nan``,
``inf``, ``infinity`` in any case, each with an optional sign. The oracle below spells that out case by case.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from gradagg.rows.formats import _csv

_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def oracle(cell: str) -> bool:
    unsigned = cell[1:] if cell[:1] in ("+", "-") else cell
    special = unsigned.isascii() and unsigned.lower() in ("nan", "inf", "infinity")
    return special or _DECIMAL.fullmatch(cell) is not None


@settings(derandomize=True, max_examples=2000, deadline=None)
@given(st.text(alphabet="0123456789+-.eEnNaAiIfFtTyY \u0131\u0130", max_size=10))
def test_number_is_the_grammar(cell: str) -> None:
    assert _csv.is_number(cell) == oracle(cell)


def test_known_cells() -> None:
    yes = ["0", "-7", "+7", "007", "1.", ".5", "1e-3", "2.5E+10", "nan", "-NaN", "+inf", "Infinity", "-INFINITY"]
    no = ["", ".", "e5", "1e", "nan1", "infinit", "1_0", " 1", "\u0131nf", "--1", "0x10"]
    assert all(_csv.is_number(c) for c in yes) and not any(_csv.is_number(c) for c in no)
