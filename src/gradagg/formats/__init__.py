"""File formats: read and write only; the contract is applied by :mod:`gradagg.engine` and :mod:`gradagg.reference`.

* :mod:`gradagg.formats.text`: JSON, JSON Lines and CSV (standard library only).
* :mod:`gradagg.formats.arrow`: the one Arrow-to-NumPy adapter (tables, record batches).
* :mod:`gradagg.formats.parquet`: Parquet in record batches, through the Arrow adapter.
"""
