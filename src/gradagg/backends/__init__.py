"""Fast paths for the two contracts, one module per array framework.

Each backend module (:mod:`gradagg.backends.numpy`, :mod:`gradagg.backends.torch`)
exposes the same names:

``owner_sum(shard_ids, worker_ids, owner_ids, gradients, *, nonfinite)``
    Owner-only shard reduction over columns; returns ``(shards, totals)``.
``microbatch_mean(values, present, *, nonfinite, parameter_offset)``
    Mean over M microbatches with explicit absence; the divisor is M.
``OwnerSumAccumulator`` / ``MicrobatchMeanAccumulator``
    The same contracts fed in batches (``update(...)`` then ``result()``).

Nothing here imports a framework: importing :mod:`gradagg.backends` is free,
and each backend module imports its framework itself. :mod:`gradagg.engine` is
the one place that chooses a backend for an input and converts between
frameworks; no backend calls another. :mod:`gradagg.backends.python` is the
reference itself behind the same names (slow, obviously right).

Private helpers, NumPy only, shared by the fast backends: ``_checks`` (input
checks and the one NaN locator), ``_strings`` (ids held as Python keys, with
integer codes), ``_factor`` (sorted factorisation of integer and ``<U`` ids),
``_tables`` and ``_mean`` (the NumPy backend's owner-sum tables and mean),
``_kernels`` (numba kernels, optional), ``_rows`` (the engine's one conversion
of the reference's Python rows into columns).
"""
