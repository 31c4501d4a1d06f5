"""One padding microbatch of the shards form (see :mod:`.padding`): it counts nowhere, and its failure is told.

Counts nowhere: the padding's gradients are dropped in their hooks (:mod:`.opening`), and what the next real
microbatch would see of it is put back as the padding found it (:func:`kept`): every buffer of the module, the
random number generators' states (dropout draws from them) and the modules' plain attributes.

A failure: the other ranks are inside a real microbatch, in FSDP2's all-gathers and reduce-scatters, which
this rank must join or they wait out the collective timeout. So when the padding function raises or returns
what cannot be back-propagated, this rank completes the round with a *stand-in* whose collectives are the
same as a real microbatch's, and reports the failure at the next round's agreement, where every rank raises
(:func:`.padding.agree`). The stand-in is, in order of preference: a zero loss over the root module's output
(the forward completed: only its backward is missing); a replay of this rank's last real inputs (the model
did not run yet). Where neither is possible (the failure came inside the model's forward, or this rank
has no inputs of its own), the collectives cannot be completed: this rank raises at once, and the others
fail in FSDP's collectives after the timeout. A padding function that calls an FSDP submodule before the
root (``model.blocks[0](x)``: FSDP's collectives would pair with the wrong module's on the other ranks) is
stopped before that submodule's all-gather, and counts as a failure before the model ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from gradagg.errors import CollectiveError, GradaggError, first_line
from gradagg.torch.accumulate.params import fsdp1_class
from gradagg.torch.accumulate.state import State
from gradagg.torch.placements import is_dtensor

if TYPE_CHECKING:
    from gradagg.torch.accumulate.wrappers.padding import Pad, Round


class Sides(Protocol):
    def set_all_reduce(self, now: bool) -> None:
        """HSDP: whether the next backward all-reduces over the replicas (a no-op without replicas)."""


class Padder(Protocol):
    """A shards form that pads (FSDP2's :class:`~.fsdp_shards.FsdpShards`, FSDP1's :class:`~.fsdp1.Fsdp1Shards`):
    the state :mod:`.padding` and this module read and write (see ``FsdpShards``'s attributes)."""

    @property
    def side(self) -> Sides:
        """Where HSDP's all-reduce over the replicas is switched (see :func:`.padding.pad_once`)."""

    rounds: bool
    zero_padding_loss: bool
    pad: Pad
    padding: bool
    kept: list[tuple[tuple[Any, ...], dict[str, Any]]] | None
    fresh: bool
    failure: str | None
    agreed: Round | None
    done: bool
    padded: int


class Watch:
    """Hooks held while a padding forward runs: whether the root's forward started, its output, and a guard
    on every FSDP submodule that refuses a forward reaching it before the root's (no collective issued yet)."""

    def __init__(self, module: torch.nn.Module | None) -> None:
        self.started, self.output, self.handles = False, None, list[Any]()
        if module is None:
            return
        from torch.distributed.fsdp import FSDPModule  # public since torch 2.6

        self.handles.append(module.register_forward_pre_hook(self._start))
        self.handles.append(module.register_forward_hook(self._keep))
        for name, sub in module.named_modules():
            sharded = isinstance(sub, FSDPModule)  # a bool: narrowing sub to FSDPModule would hide nn.Module's API
            if sub is not module and sharded:
                self.handles.append(sub.register_forward_pre_hook(self._guard(name), prepend=True))

    def _start(self, *_: object) -> None:
        self.started = True

    def _keep(self, _module: object, _args: object, output: Any) -> None:
        self.output = output

    def _guard(self, name: str) -> Any:
        def hook(*_: object) -> None:
            if not self.started:
                raise GradaggError(
                    f"reached the FSDP module {name!r} without the forward of the module given to the accumulator: "
                    "a padding forward must run the whole model, as a real microbatch does (FSDP2's collectives "
                    "pair module by module)")
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run(state: State, sh: Padder, running: list[int]) -> str | None:
    """Run one padding forward and backward; None, or what went wrong (the round completed with a stand-in).

    Raises:
        GradaggError: a failure no stand-in can complete (this rank only: the others fail in FSDP's collectives).
        CollectiveError: a collective failed inside the padding (a running rank failed or left).
    """
    module = state.params.module
    watch = Watch(module)
    try:
        with torch.enable_grad(), kept(module, state.device):
            failure, loss = None, None
            try:
                loss = checked(sh.pad() if callable(sh.pad) else replay(state, sh))
            except Exception as exc:  # noqa: BLE001 - any failure: the round's collectives must still complete
                failure = f"rank {state.rank}: the padding microbatch ({_named(sh.pad)}) {_what(exc)}"
                loss = _stand_in(state, sh, watch, exc, running, failure)
            _backward(state, loss * 0.0 if sh.zero_padding_loss else loss, running)
            return failure
    finally:
        watch.close()


def _stand_in(
    state: State, sh: Padder, watch: Watch, exc: Exception, running: list[int], failure: str
) -> torch.Tensor:
    if backend_error(exc):
        raise _peer_failed(state, exc, running) from exc
    if watch.output is not None:
        loss = zero_loss(watch.output)
        if loss is not None:
            return loss
    elif not watch.started and sh.kept is not None:
        return replay(state, sh)
    raise GradaggError(
        f"{failure}; nothing can complete this round's FSDP collectives in its place (the model's forward "
        f"{'failed inside' if watch.started else 'did not run, and this rank ran no forward of its own'}): "
        f"ranks {running} will fail in them after the collective timeout") from exc


def _backward(state: State, loss: torch.Tensor, running: list[int]) -> None:
    try:
        loss.backward()  # type: ignore[no-untyped-call]
    except Exception as exc:
        if backend_error(exc):
            raise _peer_failed(state, exc, running) from exc
        raise GradaggError(f"rank {state.rank}: the padding microbatch's backward raised "
                           f"{type(exc).__name__}: {first_line(exc)}; ranks {running} will fail in FSDP's "
                           "collectives after the collective timeout") from exc


def checked(loss: object) -> torch.Tensor:
    """The padding's loss, if it can be back-propagated as a real one: one element, with a gradient."""
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.numel() != 1:
        shown = (f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
                 if isinstance(loss, torch.Tensor) else type(loss).__name__)
        raise GradaggError(f"returned {shown}; the padding's loss must be a one-element tensor with a gradient")
    return loss


def backend_error(exc: BaseException) -> bool:
    # DistError is what torch raises for a backend failure; gloo's transport errors (a peer closed its
    # connection, a receive timed out) still reach Python as plain RuntimeErrors naming gloo.
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc).lower())


def _peer_failed(state: State, exc: BaseException, running: list[int]) -> CollectiveError:
    return CollectiveError(
        f"rank {state.rank}: a collective failed inside this rank's padding microbatch, while ranks "
        f"{running} ran real ones (one of them probably raised or left): {first_line(exc)}")


def _what(exc: BaseException) -> str:
    if isinstance(exc, GradaggError):
        return str(exc)
    return f"raised {type(exc).__name__}: {first_line(exc)}"


def _named(pad: object) -> str:
    fn = getattr(pad, "func", pad)  # a functools.partial: the function it calls
    return "pad='replay'" if pad == "replay" else f"pad={getattr(fn, '__qualname__', type(fn).__name__)}"


@contextmanager
def kept(module: torch.nn.Module | None, device: torch.device) -> Iterator[None]:
    """Leave what a real microbatch after the block would see as the block found it: a padding counts nowhere.

    Its buffers (:func:`buffers_kept`), the random number generators (:func:`rng_kept`), the modules' plain
    attributes (:func:`attributes_kept`): a model with dropout trains the same with and without padding rounds.
    """
    with rng_kept(device), attributes_kept(module), buffers_kept(module):
        yield


@contextmanager
def rng_kept(device: torch.device) -> Iterator[None]:
    """Put back the CPU generator's state, and ``device``'s when it is an accelerator, after the block.

    A padding forward in training mode draws dropout masks: without this the next real microbatch of this rank
    would draw other masks than it draws where no rank pads. ``torch.random.fork_rng`` saves and restores the
    states (the CPU's always; the accelerator's only for the device named, not every visible one).
    """
    if device.type in ("cpu", "meta"):
        devices: list[int] = []
        kind = None
    else:
        index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
        devices, kind = [index], device.type
    with torch.random.fork_rng(devices=devices, device_type=kind):
        yield


@contextmanager
def attributes_kept(module: torch.nn.Module | None) -> Iterator[None]:
    """Put back every module's plain attributes as the block found them (a forward that counts its calls).

    Plain: what a module keeps in its ``__dict__`` beside what every ``nn.Module`` keeps there (its parameters,
    buffers, submodules, hooks and ``training``). After the block each such attribute is bound again to the object
    it was bound to (``self.calls += 1`` on an int rebinds it), one the block added is removed, and the contents
    of a list, dict or set and the values of a plain tensor are put back in place (shallow: the same elements).
    Not seen: a change inside any other object (a custom class's own attributes, a list's elements): such a
    forward must not count in its padding, or use ``pad=fn`` with a function that leaves its state alone.
    Memory: a shallow copy of each list, dict and set, and a copy of each plain tensor attribute.
    """
    if module is None:
        yield
        return
    torch_own = frozenset(vars(torch.nn.Module()))
    fsdp1 = fsdp1_class()
    saved = []
    for mod in module.modules():
        if fsdp1 is not None and isinstance(mod, fsdp1):
            continue  # FSDP1's own bookkeeping, not the model's state: FSDP1 moves it on in every forward
        own = {k: v for k, v in vars(mod).items() if k not in torch_own and not _fsdp1_view(v)}
        saved.append((mod, own, {k: _contents(v) for k, v in own.items()}))
    try:
        yield
    finally:
        for mod, own, contents in saved:
            attrs = vars(mod)
            for name in [k for k in attrs if k not in torch_own and k not in own]:
                del attrs[name]
            for name, value in own.items():
                attrs[name] = value
                _put_back(value, contents[name])


def _fsdp1_view(value: object) -> bool:
    """A view of a parameter kept as a plain attribute: FSDP1's original parameters (``use_orig_params=False``),
    rebound by FSDP1 to its unsharded flat parameter at every forward, their storage freed between (a copy of one
    would read freed memory)."""
    return isinstance(value, torch.Tensor) and isinstance(value._base, torch.nn.Parameter)


def _contents(value: object) -> object:
    """What :func:`attributes_kept` puts back into ``value`` in place (None: nothing, only its binding)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.detach().clone()
    if isinstance(value, list | dict | set):
        return value.copy()
    return None


def _put_back(value: Any, contents: Any) -> None:
    if isinstance(value, torch.Tensor):
        # only where the values changed: an in-place write bumps the tensor's version, which a graph that saved it
        # (an attribute kept from the last real microbatch) would refuse at its backward
        if contents is not None and value.shape == contents.shape and not torch.equal(_local(value), _local(contents)):
            with torch.no_grad():
                value.copy_(contents)
    elif isinstance(value, list):
        value[:] = contents
    elif isinstance(value, dict | set):
        value.clear()
        value.update(contents)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``torch.equal`` on DTensors gathers over their mesh: a collective only this padding
    rank would issue), or ``t``."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]


@contextmanager
def buffers_kept(module: torch.nn.Module | None) -> Iterator[None]:
    """Leave every buffer of ``module`` as the block found it: padding counts nowhere.

    A padding forward runs the model in training mode: a token counter, BatchNorm's running statistics and
    ``num_batches_tracked``, an MoE router's load counts would take it as a real batch. Each buffer (plain or
    DTensor; FSDP2 shards parameters, not buffers) is copied before and written back in place after (after the
    backward too: a backward hook may count); one the forward reassigned is put back as the same tensor
    object (a reference taken elsewhere stays right), and one registered during the block is removed.
    Memory: one copy of the module's buffers while the block runs.
    """
    if module is None:
        yield
        return
    mods = list(module.modules())
    saved = [(mod, name, buf, buf.detach().clone()) for mod in mods for name, buf in mod.named_buffers(recurse=False)]
    before = {(id(mod), name) for mod, name, _, _ in saved}
    try:
        yield
    finally:
        with torch.no_grad():
            for mod, name, buf, value in saved:
                if getattr(mod, name, None) is not buf:
                    setattr(mod, name, buf)  # Module.__setattr__ puts a tensor back into a registered buffer
                buf.copy_(value)
            for mod in mods:
                for name in [n for n, _ in mod.named_buffers(recurse=False) if (id(mod), n) not in before]:
                    delattr(mod, name)


def replay(state: State, sh: Padder) -> torch.Tensor:
    """``pad="replay"``: every forward of this rank's last microbatch run again (the root module's inputs, in
    order: each forward all-gathers, as the real microbatches' do), the outputs' floating tensors summed."""
    module = state.params.module
    if sh.kept is None or module is None:
        raise GradaggError(
            f"rank {state.rank}: pad='replay' has no forward inputs to replay (no forward through the "
            "module given to the accumulator ran on any rank); pass pad=fn"
        )
    parts: list[torch.Tensor] = []
    for args, kwargs in _map(sh.kept, lambda t: t.detach()):
        out = module(*args, **kwargs)
        found = [t.float().sum() for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
        if not found:
            parts = []
            break
        parts += found
    if not parts:
        raise GradaggError("pad='replay': the module's output holds no floating tensor with a gradient; pass pad=fn")
    return torch.stack(parts).sum()


def zero_loss(output: object) -> torch.Tensor | None:
    """A zero loss that back-propagates zeros through every floating output tensor with a gradient; None if none.

    What stands in for a failed loss, so that the collectives a backward drives (FSDP's, a pipeline's) still pair.

    >>> x = torch.ones(2, requires_grad=True)
    >>> zero_loss({"logits": x * 2, "ids": torch.tensor([1])}).item(), zero_loss(torch.tensor([1]))
    (0.0, None)
    """
    parts = [t.sum() * 0.0 for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    return torch.stack(parts).sum() if parts else None


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of tuples, lists and dicts (a ``ModelOutput`` is a dict)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def to_cpu(kept: Any) -> Any:
    return _map(kept, lambda t: t.detach().cpu())


def to_device(kept: Any, device: torch.device) -> Any:
    return _map(kept, lambda t: t.to(device))
