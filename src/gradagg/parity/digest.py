"""Digests of a model and a window: the same in every process, or the parity check would mean nothing.

Tensors by dtype, shape and bytes; containers element by element; other objects by their fields,
their pickle, or their ``repr``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def model_digest(model: torch.nn.Module) -> dict[str, str]:
    """Name -> digest of dtype, shape and bytes of every parameter and buffer (``state_dict()``)."""
    return {name: _tensor_digest(t) for name, t in model.state_dict().items()}


def first_difference(a: dict[str, str], b: dict[str, str]) -> str | None:
    """A phrase naming the first entry in which two model digests differ, or None when they are equal.

    >>> first_difference({"w": "1"}, {"w": "2"})
    "parameter 'w'"
    """
    if list(a) != list(b):
        return f"the parameter names ({sorted(set(a) ^ set(b))} in only one)"
    return next((f"parameter {name!r}" for name in a if a[name] != b[name]), None)


def _tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype} {list(t.shape)}".encode())
    h.update(_tensor_bytes(t))
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else b""


def data_digest(obj: Any) -> str:
    """A digest of a window of arbitrary objects: tensors by dtype, shape and bytes; containers element-wise.

    Best effort for other objects: their fields (dataclasses, ``__dict__``), else their pickle, else ``repr``.

    >>> data_digest([1, (2.0, "a")]) == data_digest([1, (2.0, "a")])
    True
    """
    h = hashlib.sha256()
    _feed(h, obj, depth=0)
    return h.hexdigest()


def _feed(h: Any, obj: Any, depth: int) -> None:
    if depth > 50:  # a cycle or an absurdly deep structure: stop, the rest is not compared
        return
    if hasattr(obj, "detach") and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        h.update(b"T" + _tensor_digest(obj).encode())
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}[{len(obj)}]".encode())
        for item in obj:
            _feed(h, item, depth + 1)
    elif isinstance(obj, dict):
        h.update(f"dict[{len(obj)}]".encode())
        for key, value in obj.items():
            _feed(h, key, depth + 1)
            _feed(h, value, depth + 1)
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(repr(obj).encode())
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        fields = ({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj)
                  else vars(obj))
        h.update(type(obj).__qualname__.encode())
        _feed(h, fields, depth + 1)
    else:
        h.update(_opaque_bytes(obj))


def _opaque_bytes(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj)
    except Exception:  # unpicklable: its repr is the best we have
        return repr(obj).encode()

