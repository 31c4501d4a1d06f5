"""gradagg's compiled parts, each optional: the Parquet page decoder, the owner-sum table, the result's text; in C.

``setup.py`` builds them where a C compiler is found (``pip install .``); where
none is, or a build fails, the package installs without them and every caller
takes its pure path instead (the Parquet command then reads with pyarrow and
reduces with NumPy: the same answers, slower). ``GRADAGG_NATIVE=0`` in the
environment makes :func:`load` answer None as if they were not built (the
tests run both ways).

* ``_pqdecode``: decode one column chunk's pages (:mod:`gradagg.formats.parquet_native`);
* ``_ownersum``: the owner-sum table of :mod:`gradagg.backends.native`;
* ``_pairtext``: that table's result columns as JSON or CSV text (:mod:`gradagg.formats.text`).

Sources: ``pqdecode.c`` (with ``buffer.h``), ``ownersum.c`` and ``pairtext.c`` beside this file.
"""

from __future__ import annotations

import os
from array import array
from importlib import import_module
from types import ModuleType
from typing import Any


def load(name: str) -> ModuleType | None:
    """The compiled module ``gradagg._native.<name>``, or None if it is not built or ``GRADAGG_NATIVE=0``.

    Args:
        name: ``"_pqdecode"``, ``"_ownersum"`` or ``"_pairtext"``.

    Returns:
        The module, or None.

    >>> load("_missing") is None
    True
    """
    if os.environ.get("GRADAGG_NATIVE") == "0":
        return None
    try:
        return import_module(f"gradagg._native.{name}")
    except ImportError:
        return None


def is_table_result(shards: Any, totals: Any) -> bool:
    """Whether two columns are the owner-sum table's result: ``array("q")`` shards, as many ``"q"``/``"d"`` totals.

    The one test the native writers (JSON/CSV text, Parquet) apply before they take a result; anything
    else is written by their pure-Python or pyarrow counterparts.

    >>> is_table_result(array("q", [1]), array("d", [2.0])), is_table_result(array("q", [1]), [2.0])
    (True, False)
    """
    return (isinstance(shards, array) and shards.typecode == "q" and isinstance(totals, array)
            and totals.typecode in ("q", "d") and len(shards) == len(totals))
