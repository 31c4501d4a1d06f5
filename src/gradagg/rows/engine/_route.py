"""The engine's choice of a backend for an input, and its conversions in and out of that backend.

Part of :mod:`gradagg.rows.engine`, the one place that chooses a backend and converts
between frameworks: :func:`resolve_engine` turns ``"auto"`` into an engine by
the input's kind (:func:`kind`, which imports no framework; it is the one
chooser, ``"numba"`` included), :func:`backend`
imports that backend (statically, behind :class:`gradagg.rows.backends.Backend`, so
the type checker sees the call), and a :class:`Route` holds it and converts each
column for it (NumPy arrays, torch tensors on their device, Python lists) and
each result back into the input's kind. Nothing else changes the path: no
environment variable, no module global.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from gradagg.errors import GradaggError
from gradagg.options import Engine, check_engine, install_hint

if TYPE_CHECKING:
    from gradagg.rows.backends import Backend

BackendName = str  # "python", "numpy", "numba" or "torch": an engine once "auto" is resolved

_EXTRA = {"numpy": "rows", "numba": "jit", "torch": "torch"}  # the extra that installs each engine's framework


def resolve_engine(engine: str, sample: Any) -> BackendName:
    """Turn ``engine`` (maybe ``"auto"``) into the engine that will run ``sample``.

    Args:
        engine: one of :data:`gradagg.options.ENGINES`.
        sample: the gradients column (or values), whose kind decides ``"auto"``.

    Returns:
        ``"python"``, ``"numpy"``, ``"numba"`` or ``"torch"``: ``"auto"`` is
        numba (the NumPy backend with fused kernels) for NumPy arrays, Arrow
        tables and CPU tensors NumPy can view (zero-copy; results come back as
        tensors) where numba is installed; torch for other tensors (CUDA,
        bfloat16); else numpy where NumPy is installed (lists, or no numba),
        else python. This is the
        only place ``"auto"`` is decided; a caller that must not pay numba's
        import (the command line, for one file) passes ``"numpy"`` itself.

    Raises:
        GradaggError: an unknown engine.

    >>> resolve_engine("python", [1.0])
    'python'
    >>> resolve_engine("auto", [1.0])
    'numpy'
    """
    chosen: Engine = check_engine(engine)
    if chosen != "auto":
        return chosen
    sample_kind = kind(sample)
    if sample_kind == "torch" and not _numpy_viewable(sample):
        return "torch"
    if sample_kind in ("numpy", "arrow", "torch") and importable("numba"):
        return "numba"
    return "numpy" if importable("numpy") else "python"


# torch dtypes NumPy views without a copy: a CPU tensor of one of them runs the fused NumPy kernels
_VIEWABLE = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")


def _numpy_viewable(t: Any) -> bool:
    """Whether a tensor is on the CPU in a dtype NumPy can view (the torch ops path is for other devices)."""
    return t.device.type == "cpu" and str(t.dtype).removeprefix("torch.") in _VIEWABLE


def backend(name: BackendName) -> Backend:
    """The backend module of an engine, imported on first use.

    Raises:
        GradaggError: its framework is not installed, in one line naming the install.
    """
    try:
        if name == "numpy":
            from gradagg.rows.backends import numpy as numpy_backend

            return numpy_backend
        if name == "numba":
            from gradagg.rows.backends import numba as numba_backend

            return numba_backend
        if name == "torch":
            from gradagg.rows.backends import torch_tensors as torch_backend

            return torch_backend
    except ImportError as exc:
        missing = exc.name or str(exc)
        raise GradaggError(
            f"engine={name!r} needs {missing}, which is not installed; install it with: {install_hint(_EXTRA[name])}"
        ) from None
    from gradagg.rows.backends import python as python_backend

    return python_backend


_NUMPY_BACKENDS = ("numpy", "numba")  # the backends that take NumPy arrays


class Route:
    """The backend for a call and the conversions in and out of it, decided once from the first batch."""

    def __init__(self, engine: str, ids_sample: Any, values_sample: Any) -> None:
        self.name = resolve_engine(engine, values_sample)
        self.backend = backend(self.name)
        self.ids_kind, self.values_kind = kind(ids_sample), kind(values_sample)
        self.ids_device = ids_sample.device if self.ids_kind == "torch" else None
        self.device = values_sample.device if self.values_kind == "torch" else None

    def ids_in(self, x: Any) -> Any:
        """Ids for the backend: NumPy for numpy (torch viewed without a copy on CPU); else as given."""
        return _numpy_of(x) if self.name in _NUMPY_BACKENDS and kind(x) == "torch" else x

    def numbers_in(self, x: Any) -> Any:
        """Gradients, values or masks in the backend's array kind (``None`` stays ``None``)."""
        if x is None or self.name == "python":
            return x
        if self.name in _NUMPY_BACKENDS:
            return _numpy_of(x) if kind(x) == "torch" else x
        return x if kind(x) == "torch" else _tensor_of(x, self.device)

    def ids_out(self, shards: Any) -> Any:
        """Integer shards as the shard ids came (tensor or NumPy); string shards stay NumPy objects."""
        if self.ids_kind == "torch" and kind(shards) == "numpy" and shards.dtype.kind in "iu":
            return _tensor_of(shards, self.ids_device)
        return _numpy_of(shards) if self.ids_kind != "torch" and kind(shards) == "torch" else shards

    def values_out(self, values: Any) -> Any:
        """Totals or means as the gradients came: a tensor on their device, or NumPy."""
        if self.values_kind == "torch" and kind(values) == "numpy":
            return _tensor_of(values, self.device)
        return _numpy_of(values) if self.values_kind != "torch" and kind(values) == "torch" else values

    def concatenate(self, parts: list[Any]) -> Any:
        """One array of per-batch results (a mean file's parameter batches), in the parts' own kind."""
        if parts and kind(parts[0]) == "torch":
            import torch

            return torch.cat(parts)
        import numpy as np

        return np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)


def _numpy_of(t: Any) -> Any:
    """A NumPy array of a tensor: a zero-copy view on CPU, a host copy otherwise.

    NumPy has no bfloat16: such a tensor is copied to float32, which holds every bfloat16 value exactly.
    """
    if kind(t) != "torch":
        return t
    if str(t.dtype) == "torch.bfloat16":
        import torch

        t = t.to(torch.float32)
    return t.detach().cpu().numpy()


def _tensor_of(x: Any, device: Any) -> Any:
    """A tensor of NumPy or Python numbers, checked first (bools, strings, beyond int64) by the NumPy checks."""
    import numpy as np
    import torch

    from gradagg.rows.backends import _checks

    if not isinstance(x, (np.ndarray, list, tuple)):  # one number (an item of list-of-lists input)
        x = _checks.as_gradients([x], "values").reshape(())
    elif isinstance(x, np.ndarray):
        x = x if x.dtype.kind in "biuf" else _checks.widen(x, "values")
    elif not (len(x) and all(isinstance(v, bool) for v in x)):  # a list of bools is a mask; else numbers
        x = _checks.as_gradients(x, "values")
    else:
        x = np.array(x, dtype=bool)
    if not x.flags.writeable or not x.flags.c_contiguous:  # torch.from_numpy wants writable, contiguous memory
        x = np.array(x)
    t = torch.from_numpy(x)
    return t if device is None else t.to(device)


def kind(x: Any) -> str:
    """Classify an input without importing any framework, by its type's module: torch, numpy, arrow, list, other."""
    root = type(x).__module__.split(".")[0]
    if root in ("torch", "numpy", "pyarrow"):
        return {"pyarrow": "arrow"}.get(root, root)
    return "list" if isinstance(x, (list, tuple)) else "other"


def importable(name: str) -> bool:
    """Whether a framework can be imported, without importing it (a module set to None in sys.modules cannot)."""
    if name in sys.modules:  # the common case (NumPy arrays in hand): no search of the path
        return sys.modules[name] is not None
    import importlib.util

    return importlib.util.find_spec(name) is not None
