"""Fast paths for the two contracts, one module per array framework.

Each backend module (:mod:`gradagg.backends.numpy`, :mod:`gradagg.backends.torch`)
exposes the same names:

``owner_sum(shard_ids, worker_ids, owner_ids, gradients, *, nonfinite)``
    Owner-only shard reduction over columns; returns ``(shards, totals)``.
``microbatch_mean(values, present, *, nonfinite)``
    Mean over M microbatches with explicit absence; the divisor is M.
``OwnerSumAccumulator`` / ``MicrobatchMeanAccumulator``
    The same contracts fed in batches (``update(...)`` then ``result()``).

Nothing here imports a framework: importing :mod:`gradagg.backends` is free,
and each backend module imports its framework itself. :mod:`gradagg.engine` is
the one place that chooses a backend for an input. :mod:`gradagg.backends.python`
is the reference itself behind the same names (slow, obviously right); the
private modules (``_checks``, ``_factor``, ``_kernels``) are shared helpers of
the fast backends.
"""
