"""A flat buffer that is reused only when nobody still looks at the previous one.

Large fresh allocations are not free: a new CPU buffer of tens of megabytes is
page-faulted in on first touch, which can cost more than the all_reduce it
feeds. The accumulator and owner_reduce hand out *views* of their flat buffer
(as ``.grad`` or as results), so reusing it blindly would overwrite gradients a
caller still holds. This class reuses the buffer only when no tensor other than
its own still shares the storage (the caller dropped every view:
``zero_grad(set_to_none=True)``, results gone out of scope), and otherwise
allocates a new one: never wrong, fast in the usual training loop.
"""

from __future__ import annotations

import torch


def _use_count(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage, or None where torch cannot tell.

    PRIVATE torch API: ``torch._C._storage_Use_Count`` of ``UntypedStorage._cdata`` (torch has no public way
    to ask whether a storage is still shared). Public fallback, taken wherever it is missing or fails: None, and
    :class:`ReusableBuffer` then never reuses a buffer (always a fresh one: never wrong, slower on CPU);
    ``tests/torch/test_buffers.py`` runs the accumulator on that fallback.
    """
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    try:
        return int(counter(t.untyped_storage()._cdata))
    except (TypeError, RuntimeError, AttributeError):
        return None


class ReusableBuffer:
    """One flat buffer, handed out again only once every view of it has been dropped.

    >>> pool = ReusableBuffer()
    >>> a = pool.get(4, torch.float32, torch.device("cpu"), zero=True)
    >>> view = a[:2]
    >>> pool.get(4, torch.float32, torch.device("cpu"), zero=True) is a  # a view is alive: a new buffer
    False
    >>> del view, a
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._baseline: int | None = None

    def get(self, size: int, dtype: torch.dtype, device: torch.device, *, zero: bool) -> torch.Tensor:
        """A buffer of ``size`` elements: the previous one if it is free and fits, else a new one.

        Args:
            size: number of elements.
            dtype: element type.
            device: where it lives.
            zero: fill with zeros (otherwise the contents are undefined).

        Returns:
            A 1-d contiguous tensor.
        """
        buf = self._buf
        if buf is not None and self._free(buf) and buf.numel() == size and buf.dtype == dtype and buf.device == device:
            return buf.zero_() if zero else buf
        self._buf = None  # drop ours first: the old buffer now lives exactly as long as its views
        buf = torch.zeros(size, dtype=dtype, device=device) if zero else torch.empty(size, dtype=dtype, device=device)
        self._buf, self._baseline = buf, _use_count(buf)
        return buf

    def release(self) -> None:
        """Forget the buffer (its memory goes once no view of it is alive); the next get() allocates.

        >>> pool = ReusableBuffer(); _ = pool.get(2, torch.float32, torch.device("cpu"), zero=True); pool.release()
        """
        self._buf, self._baseline = None, None

    def _free(self, buf: torch.Tensor) -> bool:
        count = _use_count(buf)
        return count is not None and count == self._baseline
