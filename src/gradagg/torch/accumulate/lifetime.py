"""An accumulator's lifetime and identity: one live accumulator per parameter, released when dropped, named alike
on every rank.

* **Released when dropped.** The hooks on the parameters hold the :class:`~.state.State`, never the public
  :class:`~gradagg.torch.MicrobatchAccumulator`, and nothing the state holds refers back to it; a
  ``weakref.finalize`` on the public object runs :func:`release` (what ``close()`` does) when its last reference
  goes. So an accumulator built in a step function and dropped on return (nanoGPT's loop) removes its hooks and
  leaves the guard (:mod:`gradagg.torch.guard`) at once, as ``close()`` would.
* **One per parameter.** Two live accumulators over one parameter cannot both count it (the first hook takes the
  gradient, the second finds none): the second is refused at construction, naming both (:func:`refuse_shared`).
* **The same name on every rank.** Ranks must finish the same accumulator in each collective. Its identity is
  ``(serial, fingerprint)``: the layout's fingerprint (names, shapes, dtypes, the group's ranks) and how many
  accumulators of that layout over that group this process built before it. Built in the same order on every rank
  of the group, the same accumulator has the same identity; it travels with the window's counters (:mod:`.flat`)
  and the guard's agreement, so that a rank finishing another accumulator makes every rank refuse.
"""

from __future__ import annotations

import gc
import os
import traceback
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gradagg.errors import GradaggError
from gradagg.torch import guard
from gradagg.torch.collectives import Group, is_distributed

if TYPE_CHECKING:
    from gradagg.torch.accumulate.state import State

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # src/gradagg
_serials: dict[int, int] = {}  # layout fingerprint -> accumulators of that layout built in this process


def user_site() -> str:
    """``file:line`` of the innermost frame outside gradagg: where the user's code built the accumulator."""
    for frame, line in traceback.walk_stack(None):
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE + os.sep) and "contextlib" not in path:
            return f"{os.path.basename(path)}:{line}"
    return "?"


def identify(
    names: Sequence[str], tensors: Sequence[torch.Tensor], ranks: Sequence[int], shapes: Sequence[str] | None = None
) -> tuple[int, int]:
    """``(serial, fingerprint)`` of a new accumulator (see the module docstring); counts it.

    ``shapes`` (the parameters' shapes as the ranks compare them, :meth:`.params.Params.shape_text`) stand for the
    tensors' own where those differ per rank (FSDP1's pieces). The group's ranks are part of the fingerprint, so
    that the serial counts the accumulators built over that group alone: a rank that also builds accumulators over
    another group (DDP on subgroups) keeps the same serials as the other members of each group.

    >>> a = identify(["w"], [torch.zeros(2)], (0,)); b = identify(["w"], [torch.zeros(2)], (0,))
    >>> b[0] - a[0], a[1] == b[1]
    (1, True)
    """
    shown = shapes if shapes is not None else [str(tuple(t.shape)) for t in tensors]  # FSDP1: the same on each rank
    text = repr([(n, s, str(t.dtype)) for n, s, t in zip(names, shown, tensors)] + [tuple(ranks)])
    fingerprint = zlib.crc32(text.encode())
    serial = _serials.get(fingerprint, 0)
    _serials[fingerprint] = serial + 1
    return serial, fingerprint


def group_ranks(group: Group) -> tuple[int, ...]:
    """The global ranks of ``group``, in its order; ``(0,)`` with no process group (or a group of one).

    >>> group_ranks(None)
    (0,)
    """
    if not is_distributed(group):
        return (0,)
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def refuse_shared(names: Sequence[str], tensors: Sequence[torch.Tensor], site: str) -> None:
    """Refuse a new accumulator over a parameter that a live one holds with a window open; close a live one that
    holds no window (it counts nothing now, and a loop's ``acc = MicrobatchAccumulator(model)`` still names the
    previous step's while the new one is built): its later use is refused, naming why.

    Raises:
        GradaggError: naming the parameter, the live accumulator and where each was built.
    """
    clash = guard.holder_of(tensors)
    if clash is not None:
        gc.collect()  # a dropped accumulator caught in a reference cycle: collected, it releases its parameters
        clash = guard.holder_of(tensors)
    while clash is not None and not clash[0].window.open:
        clash[0].superseded = site
        release(clash[0])
        clash = guard.holder_of(tensors)
    if clash is None:
        return
    other, i, k = clash
    raise GradaggError(
        f"parameter {names[k]!r} is already accumulated by {other.label()} (as {other.names[i]!r}); a second live "
        f"accumulator over it, built at {site}, would find no gradient to count (the first's hook takes it, and its "
        "window is open): finish() or discard() the first before building the new one"
    )


def release(state: State) -> None:
    """Remove every hook, leave the guard, give DDP and FSDP2 their own synchronisation back (once)."""
    if state.closed:
        return
    state.closed = True
    for _, h in state.hooked.values():
        h.remove()
    for h in state.extra_hooks:
        h.remove()
    state.hooked, state.extra_hooks = {}, []
    state.wrapper.release()


__all__ = ["group_ranks", "identify", "refuse_shared", "release", "user_site"]
