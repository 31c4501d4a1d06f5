"""SCRIPT.py for ``gradagg parity``: load it by path, check its contract, compute the one-process truth.

:func:`check_script` runs in a process of its own, with no process group (:mod:`gradagg.parity.truth`),
never in the ``gradagg`` process: the script may hang, start threads, change the working directory or
close its streams. :func:`load_script` runs on every rank too. Each of the script's functions runs in a
state the checker sets (:func:`user_state`: the checker's working directory, a stdout and stderr of
its own). The digests (:mod:`gradagg.parity.digest`) catch a model or a window that differs between
processes, or that ``full_batch_loss()`` changed, instead of blaming it on the user's step.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gradagg.errors import ScriptError
from gradagg.parity.digest import data_digest, first_difference, model_digest
from gradagg.parity.precision import DtypesSeen

if TYPE_CHECKING:  # torch loads when a check runs, not when `gradagg parity --help` parses
    import torch

REQUIRED = ("build_model", "microbatches", "full_batch_loss", "step")  # and optionally prepare(model)


@dataclass(frozen=True)
class Script:
    """A loaded SCRIPT.py: its path and its module, with the contract's functions present and callable."""

    path: str
    module: ModuleType
    cwd: str

    def call(self, name: str, *args: Any) -> Any:
        """Call the script's function ``name``; an exception becomes a :class:`ScriptError` naming it."""
        try:
            with user_state(self.cwd):
                return getattr(self.module, name)(*args)
        except Exception as exc:  # the user's code may fail in any way: say where, in one line
            raise ScriptError(f"{self.path}: {name}() raised {describe(exc)}") from None

    @property
    def has_prepare(self) -> bool:
        """Whether the script defines the optional ``prepare(model)``."""
        return callable(getattr(self.module, "prepare", None))


def load_script(path: str) -> Script:
    """Import SCRIPT.py from its path (its folder first on ``sys.path``, as ``python SCRIPT.py`` has it).

    Args:
        path: the script's path.

    Returns:
        The loaded script.

    Raises:
        ScriptError: no such file, it does not compile or import, or a required function is missing.

    >>> load_script("no/such/script.py")
    Traceback (most recent call last):
    ...
    gradagg.errors.ScriptError: no/such/script.py: no such file
    """
    check_file(path)
    cwd = os.getcwd()
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the script can import its neighbours
    module = _import(path, cwd)
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ScriptError(f"{path}: defines no {', '.join(f'{m}()' for m in missing)} (a parity script defines "
                          f"{', '.join(f'{r}()' for r in REQUIRED)}, and optionally prepare())")
    prepare = getattr(module, "prepare", None)
    if prepare is not None and not callable(prepare):
        raise ScriptError(f"{path}: prepare is a {type(prepare).__name__}, not a function")
    return Script(path, module, cwd)


def check_file(path: str) -> None:
    """Raise :class:`ScriptError` unless ``path`` is a file (a folder, or nothing, is named as such)."""
    if not os.path.isfile(path):
        raise ScriptError(f"{path}: {'is a folder, not a script' if os.path.isdir(path) else 'no such file'}")


def _import(path: str, cwd: str) -> ModuleType:
    # A name of its own per path, so two scripts both called train.py do not collide in sys.modules.
    name = "gradagg_parity_script_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    loader = importlib.machinery.SourceFileLoader(name, path)  # any extension, not only .py
    spec = importlib.util.spec_from_loader(name, loader)
    if spec is None:
        raise ScriptError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    try:
        with user_state(cwd):
            loader.exec_module(module)
    except SyntaxError as exc:
        raise ScriptError(f"{path} line {exc.lineno}: SyntaxError: {exc.msg}") from None
    except OSError as exc:
        raise ScriptError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (Exception, SystemExit) as exc:  # its top level may fail in any way, sys.exit included
        raise ScriptError(f"{path}: importing it raised {describe(exc)}") from None
    return module


@contextlib.contextmanager
def user_state(cwd: str) -> Iterator[None]:
    """Run the user's code with stdout and stderr of its own (both to this process's stderr), then restore
    the streams and the working directory ``cwd``, whatever the code did to them.

    A function that closes ``sys.stdout`` or changes the working directory then breaks nothing of the
    checker's: the report, the script's path and the next function see what they saw before.
    """
    saved = sys.stdout, sys.stderr
    stream = _own_stream()
    sys.stdout = sys.stderr = stream
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        with contextlib.suppress(Exception):
            stream.close()  # flushes what the user printed
        _restore_cwd(cwd)


def _own_stream() -> Any:
    """A text stream on a copy of file descriptor 2 (closing it closes the copy only), or /dev/null."""
    try:
        return open(os.dup(2), "w", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
    except OSError:  # stderr itself is closed
        return open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115


def _restore_cwd(cwd: str) -> None:
    try:
        if os.getcwd() == cwd:
            return
    except OSError:  # the folder it moved to was deleted
        pass
    os.chdir(cwd)


def describe(exc: BaseException) -> str:
    """``ZeroDivisionError: division by zero``, on one line; ``sys.exit(3)`` for a SystemExit.

    >>> describe(ValueError("bad\\nvalue"))
    'ValueError: bad value'
    """
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    text = tidy(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\]\s*")  # gloo's "[/path/pair.cc:553] "
_GLOO_ADVICE = re.compile(r"\s*This is typically caused by .*$")  # gloo's generic advice after the error itself
_MAX_MESSAGE = 300


def tidy(text: str) -> str:
    """One line, without C++ source locations or gloo's advice, at most 300 characters.

    >>> tidy("[/w/gloo/pair.cc:553] Connection closed by peer.\\nThis is typically caused by a crash. GLHF!")
    'Connection closed by peer.'
    """
    one_line = _GLOO_ADVICE.sub("", " ".join(_SOURCE_LOCATION.sub("", text).split()))
    return one_line if len(one_line) <= _MAX_MESSAGE else one_line[: _MAX_MESSAGE - 3] + "..."


# --- the window and the model ---------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """A usable SCRIPT.py: its window, the truth's gradients, and the digests every rank must reproduce."""

    script: Script
    window: list[Any]
    grads: dict[str, torch.Tensor | None]
    model_digest: dict[str, str]
    window_digest: str
    computes_in: str = ""  # the lowest-precision floating dtype full_batch_loss() computed in


def check_script(path: str, size: int | None = None) -> Checked:
    """Load SCRIPT.py and check all of its contract that one process can: window, model, full-batch gradient.

    Args:
        path: the script's path.
        size: the number of microbatches to ask ``microbatches(size)`` for (``gradagg parity --sweep``);
            None: ``microbatches()``.

    Returns:
        The checked script with its truth.

    Raises:
        ScriptError: whatever makes the script unusable (see :func:`load_script`, :func:`load_window`,
            :func:`build_checked`, :func:`full_batch_grads`).
    """
    return check_loaded(load_script(path), size)


def check_loaded(script: Script, size: int | None = None) -> Checked:
    """:func:`check_script` on a loaded script (the sweep checks one script at several sizes)."""
    path = script.path
    window = load_window(script, size)
    model = build_checked(script)
    digest = model_digest(model)  # before the backward, as the ranks take theirs before the step
    with DtypesSeen() as seen:
        grads = full_batch_grads(script, model, window)
    changed = first_difference(_parameters(digest, model), _parameters(model_digest(model), model))
    if changed is not None:
        raise ScriptError(f"{path}: full_batch_loss() changed the model ({changed}); it must only compute the "
                          "loss: the ranks' step starts from build_model()'s weights, so no truth to compare with")
    return Checked(script, window, grads, digest, data_digest(window), seen.lowest())


def _parameters(digest: dict[str, str], model: torch.nn.Module) -> dict[str, str]:
    """The digest's parameters only: a forward may update buffers (batch norm's running statistics)."""
    names = {name for name, _ in model.named_parameters()}
    return {name: d for name, d in digest.items() if name in names}


def load_window(script: Script, size: int | None = None) -> list[Any]:
    """``microbatches()`` (or ``microbatches(size)``), checked: a non-empty list, the same on a second call.

    Raises:
        ScriptError: not a list or tuple, empty, not ``size`` long, or different on the second call.
    """
    args = () if size is None else (size,)
    call = f"microbatches({'' if size is None else size})"
    window = script.call("microbatches", *args)
    if not isinstance(window, (list, tuple)):
        raise ScriptError(f"{script.path}: {call} returned a {type(window).__name__}, expected a list")
    if not window:
        raise ScriptError(f"{script.path}: {call} returned an empty list: nothing to check")
    if size is not None and len(window) != size:
        raise ScriptError(f"{script.path}: {call} returned {len(window)} microbatches, expected {size} (the "
                          "window's rows split into that many microbatches)")
    if data_digest(window) != data_digest(script.call("microbatches", *args)):
        raise ScriptError(f"{script.path}: {call} returned different data on a second call; it must be "
                          "deterministic (seed its generator inside the function)")
    return list(window)


def takes_size(script: Script) -> bool:
    """Whether ``microbatches`` accepts a number of microbatches, ``microbatches(n)`` (what ``--sweep`` varies)."""
    import inspect

    try:
        inspect.signature(script.module.microbatches).bind(1)
    except (TypeError, ValueError):  # takes no argument, or a builtin without a signature
        return False
    return True


def build_checked(script: Script) -> torch.nn.Module:
    """``build_model()``, checked: a module with trainable parameters, identical on a second call.

    Raises:
        ScriptError: not a module, no trainable parameter, or different weights on the second call.
    """
    import torch

    model = script.call("build_model")
    if not isinstance(model, torch.nn.Module):
        raise ScriptError(f"{script.path}: build_model() returned a {type(model).__name__}, expected a "
                          "torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ScriptError(f"{script.path}: build_model() returned a model with no trainable parameter")
    differs = first_difference(model_digest(model), model_digest(script.call("build_model")))
    if differs is not None:
        raise ScriptError(f"{script.path}: build_model() is not deterministic: {differs} differs between two "
                          "calls (seed it inside the function, e.g. torch.manual_seed(0) before building)")
    return model


def full_batch_grads(script: Script, model: torch.nn.Module, window: list[Any]) -> dict[str, torch.Tensor | None]:
    """The truth: every parameter's gradient of ``full_batch_loss(model, window)`` in this one process.

    Args:
        script: the loaded script.
        model: a fresh model from :func:`build_checked` (no gradient yet).
        window: the whole window.

    Returns:
        Parameter name -> its gradient (a CPU copy), or None where the full batch gives it none.

    Raises:
        ScriptError: the loss is not a differentiable scalar, or its gradient is non-finite or zero.
    """
    loss = script.call("full_batch_loss", model, window)
    problem = _not_a_loss(loss)
    if problem:
        raise ScriptError(f"{script.path}: full_batch_loss() returned {problem}")
    try:
        loss.backward()
    except Exception as exc:
        raise ScriptError(f"{script.path}: the backward of full_batch_loss() raised {describe(exc)}") from None
    grads = {name: read_grad(p) for name, p in model.named_parameters()}
    _check_truth(script.path, grads)
    return grads


def _not_a_loss(loss: Any) -> str | None:
    import torch

    if not isinstance(loss, torch.Tensor):
        return f"a {type(loss).__name__}, expected a scalar tensor"
    if loss.numel() != 1:
        return f"a tensor of shape {list(loss.shape)}, expected a scalar"
    if loss.grad_fn is None:
        return "a tensor that does not depend on the model's parameters (it has no grad_fn)"
    return None


def _check_truth(path: str, grads: dict[str, torch.Tensor | None]) -> None:
    import torch

    present = {n: g for n, g in grads.items() if g is not None}
    if not present:
        raise ScriptError(f"{path}: full_batch_loss() gives no parameter a gradient")
    for name, g in present.items():
        if not bool(torch.isfinite(g).all()):
            raise ScriptError(f"{path}: the full-batch gradient of {name!r} is not finite: no truth to compare with")
    if all(not bool(g.any()) for g in present.values()):
        raise ScriptError(f"{path}: the full-batch gradient is zero on every parameter: nothing to compare")


def read_grad(param: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as a CPU copy, or None (a rank reads a DTensor's with :mod:`gradagg.parity.shards`)."""
    grad = param.grad
    return None if grad is None else grad.detach().to("cpu", copy=True)
