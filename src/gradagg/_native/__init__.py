"""gradagg's compiled parts, each optional: the Parquet page decoder and the owner-sum table, in C.

``setup.py`` builds them where a C compiler is found (``pip install .``); where
none is, or a build fails, the package installs without them and every caller
takes its pure path instead (the Parquet command then reads with pyarrow and
reduces with NumPy: the same answers, slower). ``GRADAGG_NATIVE=0`` in the
environment makes :func:`load` answer None as if they were not built (the
tests run both ways).

* ``_pqdecode``: decode one column chunk's pages (:mod:`gradagg.formats.parquet_native`);
* ``_ownersum``: the owner-sum table of :mod:`gradagg.backends.native`.

Sources: ``pqdecode.c`` (with ``buffer.h``) and ``ownersum.c`` beside this file.
"""

from __future__ import annotations

import os
from importlib import import_module
from types import ModuleType


def load(name: str) -> ModuleType | None:
    """The compiled module ``gradagg._native.<name>``, or None if it is not built or ``GRADAGG_NATIVE=0``.

    Args:
        name: ``"_pqdecode"`` or ``"_ownersum"``.

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
