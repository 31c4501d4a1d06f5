"""Exactly-once microbatch accumulation over torch.distributed: :class:`MicrobatchAccumulator`, one package.

Contract (the distributed form of :func:`gradagg.reference.microbatch_mean`): after
:meth:`MicrobatchAccumulator.finish`, every parameter's ``.grad`` is

    sum over all microbatches on all ranks of its gradient  /  D

where the divisor D is counted by the accumulator and summed in the same collective as the gradients:
M, the number of microbatches actually run on all ranks; or, with ``microbatch(weight=w)``, the sum of
all the window's weights on all ranks (back-propagate the *sum*-reduced loss and weight each microbatch
by its number of valid tokens: the result is the gradient of the global token mean); or 1, when the loss
terms were divided by global divisors counted ahead (:meth:`~MicrobatchAccumulator.divisors`). With
``terms=(...)``, each loss term's sum has its own divisor, counted as the window runs (a count may come after the
term's backward, even after the last microbatch): ``.grad`` = sum over terms of the term's sum / D_term (see
:mod:`.terms_after`). A
parameter absent from a microbatch contributes zero and still counts; one absent from every microbatch on
every rank keeps ``grad is None``. Gradients that are exactly zero as a window opens
(``zero_grad(set_to_none=False)``) are absent, set to None; any other gradient then present is refused.
Participation is reported in the :class:`Ledger`, never a divisor.

How: a post-accumulate-grad hook on every parameter (under FSDP2, on the unsharded one) moves each
microbatch's gradient into one flat buffer, in buckets, and leaves ``.grad`` None until the window ends
(so ``optimizer.zero_grad()`` inside a window cannot drop counted gradients). ``finish()`` sends the
buckets, the counters travelling in the last one, divides once and hands out ``.grad`` as views of the
buffer (under FSDP2, DTensor shards). Sums are in float32 at least (bf16 and fp16 gradients included).

The modules, by composition around one :class:`~.state.State` passed explicitly (none reads another's
private attributes); each imports only those listed before it:

* :mod:`.ledger` (the report and the weighting codes), :mod:`.counting` (the weight rules: a count taken, read
  once, refused in the same words, summed exactly; shared with :mod:`gradagg.torch.pipeline`), :mod:`.window` (one
  window's counters and buffers),
  :mod:`.params` (which parameters), :mod:`.flat` (the buffer's layout), :mod:`.buckets` (sending),
  :mod:`.lifetime` (one live accumulator per parameter, released when dropped, the same identity on every rank),
  :mod:`.meshes` (the group read from a device mesh: its data dims, dp x cp, not tp), :mod:`.seam` (the
  :class:`~.seam.Wrapper` interface: what differs between plain modules, DDP and FSDP2);
* :mod:`.state` (the one object), :mod:`.hooks` (gradients into the buffer), :mod:`.stale` (gradients present as a
  window opens), :mod:`.opening` (a window opens; the hooks installed), :mod:`.terms` (divisors counted ahead),
  :mod:`.terms_after` (terms counted as the window runs, each divided in ``finish()``), :mod:`.finish` (a window
  closes), :mod:`.attaching` (finishing from an optimizer's step);
* :mod:`.wrappers`: one module per wrapper behind the seam (:mod:`~.wrappers.plain`, :mod:`~.wrappers.ddp`,
  :mod:`~.wrappers.fsdp_window`, :mod:`~.wrappers.fsdp_shards` with its rounds and padding), and the chooser;
* :mod:`.accumulator`: the public class, a thin shell over the state, which chooses the wrapper.

The core modules call the wrapper through the seam and never ask which one it is; no wrapper module is imported
below :mod:`.accumulator`.

Its slow, obviously right twin is :class:`gradagg.torch.pure.PureAccumulator`; the tests compare them.
"""

from __future__ import annotations

from gradagg.torch.accumulate.accumulator import MicrobatchAccumulator
from gradagg.torch.accumulate.ledger import Ledger
from gradagg.torch.accumulate.terms_after import Microbatch

__all__ = ["Ledger", "Microbatch", "MicrobatchAccumulator"]
