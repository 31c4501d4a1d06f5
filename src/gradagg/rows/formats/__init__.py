"""File formats: read and write only; the contract is applied by :mod:`gradagg.rows.engine` (or the reference).

* :mod:`gradagg.rows.formats.detect`: which format an input or output is in (the one table of both), an
  input's bytes (bounded by the memory allowed), and errors named after the input.
* :mod:`gradagg.rows.formats.text`: JSON, JSON Lines and CSV into rows (standard library only; the readers
  are :mod:`gradagg.rows.formats._json` and :mod:`gradagg.rows.formats._csv`).
* :mod:`gradagg.rows.formats.results`: a result written as JSON, JSON Lines, CSV or Parquet, to stdout or ``-o``.
* :mod:`gradagg.rows.formats.atomic`: a file appears whole or not at all.
* :mod:`gradagg.rows.formats.arrow`: the one Arrow-to-NumPy adapter (tables, record batches).
* :mod:`gradagg.rows.formats.parquet`: Parquet in record batches, through the Arrow adapter.
"""

from __future__ import annotations

from typing import Any

from gradagg.errors import GradaggError
from gradagg.options import install_hint


def parquet_module(error: type[GradaggError], doing: str) -> Any:
    """:mod:`gradagg.rows.formats.parquet`, imported only when Parquet is read or written (it needs pyarrow and numpy).

    Args:
        error: the error to raise without them: ``FormatError`` for an input, ``OutputError`` for a result.
        doing: ``"reading"`` or ``"writing"``, for the message.

    Raises:
        GradaggError: ``error``, naming what is missing and the extra that installs it.
    """
    try:
        from gradagg.rows.formats import parquet
    except ImportError as exc:
        raise error(f"{doing} Parquet needs pyarrow and numpy ({exc}); install them with: "
                    f"{install_hint('rows')}") from None
    return parquet
