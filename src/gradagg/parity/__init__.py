"""``gradagg parity``: prove your own distributed training step against the one-process full batch.

SCRIPT.py defines:

* ``build_model() -> torch.nn.Module``, deterministic (identical weights on every call, in every process);
* ``microbatches() -> list``, the global window (any objects), deterministic as well;
* ``full_batch_loss(model, microbatches) -> Tensor``, a scalar whose gradient, in one process over the
  whole window, is the truth;
* ``step(model, microbatches) -> None``, the distributed step under test: called on every rank of a
  local gloo world (the default process group initialised) with that rank's consecutive slice of the
  window; it must leave the synchronized gradient in each parameter's ``.grad`` (a tensor, or a DTensor);
* optionally ``prepare(model) -> model``, called on every rank before ``step`` (wrap in DDP, apply
  ``fully_shard``); ``step`` receives what it returns.

For each layout (microbatches per rank: ``(8,)``, ``(4, 4)``, ``(1, 7)``, ``(0, 8)``) one local world
runs the step; every rank's gradients, read by name from the parameters of the model that
``build_model()`` returned (a DTensor's put together from every rank's shard in this process, with no
collective after the step: :mod:`gradagg.parity.shards`), are compared with the truth,
parameter by parameter (the relative error is defined in :mod:`gradagg.parity.compare`). A layout
passes when the largest relative error over ranks and parameters is at most ``rtol``. A step that
raises, exits or hangs on some rank fails its layout, within the world's deadline: a rank whose step
fails returns at once, so a peer blocked in a collective with it fails fast, and a rank that hangs is
killed at the deadline.

:func:`sweep_parity` (``gradagg parity --sweep``) runs the step on a grid of world sizes and microbatches
per rank instead, and reports per cell ``exact`` or the factor its gradient is off (:mod:`gradagg.parity.sweep`).
"""

from gradagg.errors import ScriptError
from gradagg.parity.check import DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_TIMEOUT_S, check_parity
from gradagg.parity.command import add_arguments, run
from gradagg.parity.layouts import MAX_RANKS
from gradagg.parity.sweep import SweepReport, sweep_parity
from gradagg.parity.types import ParityReport

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "MAX_RANKS", "ParityReport", "ScriptError",
           "SweepReport", "add_arguments", "check_parity", "run", "sweep_parity"]
