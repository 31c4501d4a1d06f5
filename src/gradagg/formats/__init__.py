"""File formats: read and write only; the contract is applied by :mod:`gradagg.engine` and :mod:`gradagg.reference`.

* :mod:`gradagg.formats.detect`: which format an input or output is in (the one table of both), an
  input's bytes (bounded by the memory allowed), and errors named after the input.
* :mod:`gradagg.formats.text`: JSON, JSON Lines and CSV into rows (standard library only; the readers
  are :mod:`gradagg.formats._json` and :mod:`gradagg.formats._csv`).
* :mod:`gradagg.formats.results`: a result written as JSON, JSON Lines, CSV or Parquet, to stdout or ``-o``.
* :mod:`gradagg.formats.atomic`: a file appears whole or not at all.
* :mod:`gradagg.formats.arrow`: the one Arrow-to-NumPy adapter (tables, record batches).
* :mod:`gradagg.formats.parquet`: Parquet in record batches, through the Arrow adapter.
"""
