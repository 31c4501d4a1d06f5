"""The engine's choice of a backend for an input, and its conversions in and out of that backend.

Part of :mod:`gradagg.engine`, the one place that chooses a backend and converts
between frameworks: :func:`resolve_engine` turns ``"auto"`` into an engine by
the input's kind (:func:`kind`, which imports no framework), and a
:class:`Route` holds the chosen backend and converts each column for it (NumPy
arrays, torch tensors on their device, Python lists, or buffer columns for the
native backend) and each result back into the input's kind.
"""

from __future__ import annotations

from typing import Any

from gradagg.errors import GradaggError
from gradagg.options import check_engine


def resolve_engine(engine: str, sample: Any) -> str:
    """Turn ``engine`` (maybe ``"auto"``) into the engine that will run ``sample``.

    Args:
        engine: one of :data:`gradagg.options.ENGINES`.
        sample: the gradients column (or values), whose kind decides ``"auto"``.

    Returns:
        ``"python"``, ``"numpy"`` or ``"torch"``; for buffer columns (the native
        Parquet reader's, ``memoryview``, ``array.array``) ``"auto"`` is
        ``"native"`` (:mod:`gradagg.backends.native`, compiled) where it is built.

    Raises:
        GradaggError: an unknown engine, or one whose framework is not installed.

    >>> resolve_engine("python", [1.0])
    'python'
    """
    if check_engine(engine) == "auto":
        sample_kind = kind(sample)
        if sample_kind == "torch":
            return "torch"
        if sample_kind == "buffer" and import_module("gradagg.backends.native").available():
            return "native"
        return "numpy" if importable("numpy") else "python"
    if engine != "python" and not importable(engine):
        raise GradaggError(f"engine={engine!r} needs the {engine} package, which is not installed")
    return engine


# --- backend choice and conversions: nothing else in gradagg does either --------------------------


class Route:
    """The backend for a call and the conversions in and out of it, decided once from the first batch."""

    def __init__(self, engine: str, ids_sample: Any, values_sample: Any) -> None:
        self.name = resolve_engine(engine, values_sample)
        self.ids_kind, self.values_kind = kind(ids_sample), kind(values_sample)
        self.ids_device = ids_sample.device if self.ids_kind == "torch" else None
        self.device = values_sample.device if self.values_kind == "torch" else None
        on_cpu = self.device is None or self.device.type == "cpu"
        self.backend_name = "numpy" if self.name == "torch" and on_cpu and _cpu_tensors_via_numpy() else self.name
        self.backend = import_module(f"gradagg.backends.{self.backend_name}")

    def ids_in(self, x: Any) -> Any:
        """Ids for the backend: NumPy for numpy (torch viewed without a copy on CPU); else as given."""
        if kind(x) == "buffer" and self.backend_name != "native":
            return _list_of_buffer(x) if self.backend_name == "python" else _numpy_of_buffer(x)
        return _numpy_of(x) if self.backend_name == "numpy" and kind(x) == "torch" else x

    def numbers_in(self, x: Any) -> Any:
        """Gradients, values or masks in the backend's array kind (``None`` stays ``None``)."""
        if x is None or self.backend_name == "native":
            return x
        if kind(x) == "buffer":
            x = _list_of_buffer(x) if self.backend_name == "python" else _numpy_of_buffer(x)
        if self.backend_name == "python":
            return x
        if self.backend_name == "numpy":
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
        if parts and kind(parts[0]) == "torch":
            return import_module("torch").cat(parts)
        np = import_module("numpy")
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)


def _cpu_tensors_via_numpy() -> bool:
    chosen = import_module("gradagg.engine").CPU_TENSORS_VIA_NUMPY  # (set by tests and benchmarks)
    if chosen is not None:
        return bool(chosen)
    return bool(import_module("gradagg.backends._kernels").AVAILABLE)


def _numpy_of(t: Any) -> Any:
    """A NumPy array of a tensor: a zero-copy view on CPU, a host copy otherwise."""
    return t.detach().cpu().numpy() if kind(t) == "torch" else t


def _tensor_of(x: Any, device: Any) -> Any:
    """A tensor of NumPy or Python numbers, checked first (bools, strings, beyond int64) by the NumPy checks."""
    torch, np, checks = import_module("torch"), import_module("numpy"), import_module("gradagg.backends._checks")
    if isinstance(x, np.ndarray):
        x = x if x.dtype.kind in "biuf" else checks.widen(x, "values")
    elif not (len(x) and all(isinstance(v, bool) for v in x)):  # a list of bools is a mask; else numbers
        x = checks.as_gradients(x, "values")
    else:
        x = np.array(x, dtype=bool)
    if not x.flags.writeable or not x.flags.c_contiguous:  # torch.from_numpy wants writable, contiguous memory
        x = np.array(x)
    t = torch.from_numpy(x)
    return t if device is None else t.to(device)


def kind(x: Any) -> str:
    """Classify an input without importing any framework: by its type's module.

    ``"buffer"``: a typed ``memoryview``, an ``array.array``, or a dictionary-encoded
    buffer column (``values`` a memoryview, ``indices`` one or None), as the native
    Parquet reader yields (:class:`gradagg.formats.parquet_native.Column`).
    """
    root = type(x).__module__.split(".")[0]
    if root in ("torch", "numpy", "pyarrow"):
        return {"pyarrow": "arrow"}.get(root, root)
    if isinstance(x, memoryview) or root == "array" or isinstance(getattr(x, "values", None), memoryview):
        return "buffer"
    return "list" if isinstance(x, (list, tuple)) else "other"


def _list_of_buffer(x: Any) -> list[Any]:
    """The Python numbers of a buffer column, row by row."""
    values = memoryview(getattr(x, "values", x)).tolist()
    indices = getattr(x, "indices", None)
    return values if indices is None else [values[i] for i in memoryview(indices).tolist()]


def _numpy_of_buffer(x: Any) -> Any:
    """A NumPy array of a buffer column (a view; a dictionary-encoded column is taken through its indices)."""
    np = import_module("numpy")
    values = memoryview(getattr(x, "values", x))
    array = np.frombuffer(values, dtype=np.dtype(values.format)) if values.nbytes else np.empty(
        0, dtype=np.dtype(values.format))
    indices = getattr(x, "indices", None)
    return array if indices is None else array.take(np.frombuffer(memoryview(indices), dtype=np.uint32))


def import_module(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


def importable(name: str) -> bool:
    import sys

    if name in sys.modules:  # the common case (NumPy arrays in hand): no search of the path
        return True
    import importlib.util

    return importlib.util.find_spec(name) is not None
