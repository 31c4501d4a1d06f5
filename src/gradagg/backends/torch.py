"""PyTorch backend: both contracts on tensors, on any device.

CPU tensors are viewed as NumPy arrays (zero-copy) and run through the NumPy
backend's fused kernels when numba is installed (:data:`CPU_VIA_NUMPY`): on
CPU that is the fastest path and gives the same bits. Otherwise (CUDA, or no
numba) the contracts run as torch ops on the tensors' device:

* owner-sum: ``owned = worker == owner``; the owner rows' shard ids are
  merged into the sorted keys with ``torch.unique(sorted=True,
  return_inverse=True)``; ``index_add_`` adds each row into a float64 (or
  int64) total that starts at ``-0.0``. On CPU ``index_add_`` adds in row
  order (bit-identical to the reference, tested); on CUDA it uses atomic adds
  in no fixed order, so a total may differ from the reference by at most
  ``2 * (n - 1) * 2**-53 * sum(|g|)`` over the shard's n owner rows.
* microbatch mean: one float64 sum per parameter, microbatch by microbatch
  (elementwise, so exact on every device), divided by M.

String shard ids cannot live in a tensor: they stay a NumPy ``<U`` array on
the host, are factorised there, and only their integer codes go to the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import torch
from gradagg.backends import _checks, _factor, _kernels
from gradagg.backends import numpy as numpy_backend
from gradagg.errors import (
    GradaggError,
    GradientShapeError,
    GradientTypeError,
    IdError,
    NonFiniteGradientError,
    RowShapeError,
    UnorderableShardError,
)

# Route CPU tensors through the NumPy kernels when they are compiled (tests turn this off).
CPU_VIA_NUMPY: bool = _kernels.AVAILABLE
_INT64_MAX = 2**63 - 1


def owner_sum(
    shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any, *, nonfinite: str = "propagate"
) -> tuple[Any, Any]:
    """Owner-only shard reduction on tensors (see :func:`gradagg.engine.owner_sum_columns`).

    Args:
        shard_ids: N integer ids as a tensor, or str ids as a NumPy ``<U`` array or list.
        worker_ids: N worker ids (tensor, or strings on the host).
        owner_ids: N owner ids of the same type as ``worker_ids``.
        gradients: ``(N,)`` or ``(N, D)`` tensor; its device is where the work happens.
        nonfinite: ``"propagate"`` or ``"raise"``.

    Returns:
        ``(shards, totals)``: int shards as an int64 tensor (str shards as a NumPy
        array), totals as an int64/float64 tensor on the gradients' device.

    Raises:
        GradaggError: see :func:`gradagg.engine.owner_sum_columns`.

    >>> s, t = owner_sum(torch.tensor([3, 3, 1]), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 2]),
    ...                  torch.tensor([1.0, 9.0, 2.0]))
    >>> s.tolist(), t.tolist()
    ([1, 3], [2.0, 1.0])
    """
    acc = OwnerSumAccumulator(nonfinite=nonfinite)
    acc.update(shard_ids, worker_ids, owner_ids, gradients)
    return acc.result()


def microbatch_mean(values: Any, present: Any = None, *, nonfinite: str = "propagate") -> Any:
    """Microbatch mean on tensors (see :func:`gradagg.engine.microbatch_mean_columns`).

    Args:
        values: ``(M, P)`` tensor, or a list of M lists of P tensors (``None`` = absent).
        present: ``(M, P)`` bool tensor for tensor input; ``None`` = all present.
        nonfinite: ``"propagate"`` or ``"raise"``.

    Returns:
        ``(P,)`` float64 tensor on the values' device, or a list of P float64 tensors.

    Raises:
        GradaggError: see :func:`gradagg.engine.microbatch_mean_columns`.

    >>> microbatch_mean(torch.tensor([[2.0, 0.0], [4.0, 6.0]]), torch.tensor([[True, False], [True, True]])).tolist()
    [3.0, 3.0]
    """
    _checks.check_nonfinite_option(nonfinite)
    if isinstance(values, (list, tuple)):
        return _mean_of_lists(values, nonfinite)
    v = _numeric_tensor(values, "values")
    if CPU_VIA_NUMPY and v.device.type == "cpu":  # the one-shot NumPy path divides inside its kernel
        mask = None if present is None else _host(as_tensor(present))
        return torch.from_numpy(numpy_backend.microbatch_mean(_host(v), mask, nonfinite=nonfinite))
    acc = MicrobatchMeanAccumulator(nonfinite=nonfinite)
    acc.update(values, present)
    return acc.result()


def as_tensor(x: Any, device: Any = None) -> Any:
    """A tensor of ``x`` (NumPy array, list or tensor) on ``device``; string ids stay NumPy arrays.

    >>> as_tensor(np.array([1, 2])).tolist(), as_tensor(np.array(["a"])).dtype.kind
    ([1, 2], 'U')
    """
    if isinstance(x, torch.Tensor):
        return x if device is None else x.to(device)
    try:
        a = x if isinstance(x, np.ndarray) else np.asarray(x)
    except ValueError:  # ragged lists: left for the backend's checks to name
        return x
    if a.dtype.kind in "UOS":  # ids for the host side; a list stays a list so mixed types are still caught
        return a if isinstance(x, np.ndarray) else x
    if not a.flags.writeable or not a.flags.c_contiguous:  # torch wants to own writable memory
        a = np.array(a)
    t = torch.from_numpy(a)
    return t if device is None else t.to(device)


class OwnerSumAccumulator:
    """Owner-sum fed in batches; memory grows with distinct shards.

    Summation order: each shard's owner gradients are added in the order fed
    (on CPU exactly; on CUDA, see the module notes for the bound).

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.

    >>> acc = OwnerSumAccumulator()
    >>> acc.update(torch.tensor([7]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1.5]))
    >>> acc.update(torch.tensor([7]), torch.tensor([1]), torch.tensor([1]), torch.tensor([2.0]))
    >>> [x.tolist() for x in acc.result()]
    [[7], [3.5]]
    """

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        _checks.check_nonfinite_option(nonfinite)
        self._nonfinite = nonfinite
        self._via_numpy: numpy_backend.OwnerSumAccumulator | None = None
        self._rows = 0
        self._keys: Any = None  # sorted unique shard ids: int64 tensor, or NumPy <U array
        self._totals: Any = None
        self._device: Any = None

    def update(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any) -> None:
        """Add a batch of rows (four columns of equal length).

        Args:
            shard_ids: as for :func:`owner_sum`.
            worker_ids: as for :func:`owner_sum`.
            owner_ids: as for :func:`owner_sum`.
            gradients: as for :func:`owner_sum`.

        Raises:
            GradaggError: see :func:`owner_sum`.
        """
        grads = _numeric_tensor(gradients, "gradients")
        if self._via_numpy is not None or (self._keys is None and CPU_VIA_NUMPY and grads.device.type == "cpu"):
            if self._via_numpy is None:
                self._via_numpy = numpy_backend.OwnerSumAccumulator(nonfinite=self._nonfinite)
            cols = [_host(c) for c in (shard_ids, worker_ids, owner_ids, grads)]
            self._via_numpy.update(*cols)
            return
        shards, owned, grads = self._validate(shard_ids, worker_ids, owner_ids, grads)
        self._accumulate(shards, owned, grads)
        self._rows += len(shards)

    def result(self) -> tuple[Any, Any]:
        """Return ``(shards, totals)`` over all rows fed so far, shards sorted ascending.

        Returns:
            As for :func:`owner_sum`.
        """
        if self._via_numpy is not None:
            shards, totals = self._via_numpy.result()
            return as_tensor(shards), torch.from_numpy(totals)
        if self._keys is None:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float64)
        return self._keys, self._totals

    def _validate(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, grads: Any) -> tuple[Any, Any, Any]:
        device = grads.device
        shards = _ids("shard_ids", shard_ids, self._rows)
        workers = _ids("worker_ids", worker_ids, self._rows)
        owners = _ids("owner_ids", owner_ids, self._rows)
        if grads.dim() not in (1, 2):
            raise GradientShapeError(f"gradients must have shape (N,) or (N, D), got shape {tuple(grads.shape)}")
        if grads.dtype == torch.bool or grads.is_complex():
            raise GradientTypeError(f"gradients must be integers or floats, got {grads.dtype}")
        names = ("shard_ids", "worker_ids", "owner_ids", "gradients")
        _checks.check_lengths(dict(zip(names, (len(shards), len(workers), len(owners), len(grads)))))
        _checks.check_same_id_kind(_id_kind(workers), _id_kind(owners))
        owned = _owned(workers, owners, device)
        if self._nonfinite == "raise":
            _first_nonfinite(owned, grads, shards, self._rows)
        if self._keys is not None and _id_kind(shards) != _id_kind(self._keys):
            raise UnorderableShardError(
                f"row {self._rows}: shard ids are {_id_kind(shards)} in this batch but {_id_kind(self._keys)} before"
            )
        return shards, owned, grads

    def _accumulate(self, shards: Any, owned: Any, grads: Any) -> None:
        dtype = torch.int64 if not grads.is_floating_point() else torch.float64
        rows = grads[owned].to(dtype)
        if dtype == torch.int64:
            _int_headroom(rows, self._totals)
        if self._keys is None:
            self._device, self._keys = grads.device, shards[:0]
            self._totals = torch.empty((0, *grads.shape[1:]), dtype=dtype, device=grads.device)
        elif rows.shape[1:] != self._totals.shape[1:] or dtype != self._totals.dtype:
            raise GradientShapeError(
                f"row {self._rows}: gradients are {dtype} of shape {tuple(rows.shape[1:])}, expected "
                f"{self._totals.dtype} of shape {tuple(self._totals.shape[1:])} (from row 0)"
            )
        keys, old_pos, codes = _merge_keys(self._keys, _select(shards, owned), self._device)
        # Old totals first, then this batch's rows in row order: -0.0 + t == t keeps every total's bits.
        totals = torch.full((len(keys), *rows.shape[1:]), -0.0 if dtype.is_floating_point else 0, dtype=dtype,
                            device=self._device)
        totals.index_add_(0, old_pos, self._totals)
        totals.index_add_(0, codes, rows)
        self._keys, self._totals = keys, totals


def _numeric_tensor(x: Any, name: str) -> Any:
    """A tensor of numbers; non-tensor input is checked (bool, strings, ragged) by the NumPy checks first."""
    if isinstance(x, torch.Tensor):
        return x
    a = x if isinstance(x, np.ndarray) and x.dtype.kind in "iuf" else _checks.widen(_object_or_array(x, name), name)
    return as_tensor(a)


def _object_or_array(x: Any, name: str) -> Any:
    try:
        return np.asarray(x)
    except ValueError:
        raise GradientShapeError(f"{name}: vector gradients differ in length") from None


def _host(x: Any) -> Any:
    """A NumPy view of a CPU tensor (no copy); other inputs unchanged."""
    return x.detach().numpy() if isinstance(x, torch.Tensor) else x


def _ids(name: str, x: Any, offset: int) -> Any:
    """Integer ids as a tensor; string ids as a NumPy ``<U`` array (host side)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise RowShapeError(f"{name} must be one-dimensional (one id per row), got shape {tuple(x.shape)}")
        if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            raise IdError(f"{name} must hold int or str ids, got a {x.dtype} tensor")
        return x.to(torch.int64)
    ids, kind = _checks.as_ids(name, x, offset)
    return ids if kind == "str" else torch.from_numpy(np.array(ids, dtype=np.int64))


def _id_kind(ids: Any) -> str:
    return "int" if isinstance(ids, torch.Tensor) else "str"


def _owned(workers: Any, owners: Any, device: Any) -> Any:
    """The owner-row mask as a bool tensor on ``device``."""
    if isinstance(workers, torch.Tensor):
        return (workers.to(device) == owners.to(device)).to(device)
    return torch.from_numpy(np.asarray(workers == owners)).to(device)


def _select(ids: Any, owned: Any) -> Any:
    if isinstance(ids, torch.Tensor):
        return ids.to(owned.device)[owned]
    return ids[owned.cpu().numpy()]


def _merge_keys(old: Any, new: Any, device: Any) -> tuple[Any, Any, Any]:
    """Sorted union of the table's keys and a batch's ids; positions of each old key and each new id."""
    k = len(old)
    if isinstance(old, torch.Tensor):
        keys, inverse = torch.unique(torch.cat([old.to(device), new]), sorted=True, return_inverse=True)
        return keys, inverse[:k], inverse[k:]
    keys, inv = _factor.factorize(np.concatenate([old, new]))
    inverse = torch.from_numpy(inv).to(device)
    return keys, inverse[:k], inverse[k:]


def _first_nonfinite(owned: Any, grads: Any, shards: Any, offset: int) -> None:
    if not grads.is_floating_point():
        return
    bad = ~torch.isfinite(grads)
    rows = (bad.any(dim=1) if bad.dim() == 2 else bad) & owned
    if not bool(rows.any()):
        return
    r = int(rows.nonzero()[0, 0])
    at, value = ("", grads[r]) if bad.dim() == 1 else (f" element {int(bad[r].nonzero()[0, 0])}", grads[r][bad[r]][0])
    shard = shards[r].item() if isinstance(shards, torch.Tensor) else shards[r].item()
    raise NonFiniteGradientError(
        f"row {offset + r}: gradient of shard {shard!r}{at} is {float(value)!r}; NaN and Inf are values, not absence"
    )


def _int_headroom(rows: Any, totals: Any) -> None:
    """Refuse a batch whose integer totals could overflow int64 (conservative bound)."""
    if rows.numel() == 0:
        return
    biggest = int(rows.abs().max())
    held = int(totals.abs().max()) if totals is not None and totals.numel() else 0
    if biggest * len(rows) + held > _INT64_MAX:
        raise GradaggError(
            f"integer totals could overflow int64 (|gradient| up to {biggest} over {len(rows)} counted rows); "
            "use engine='python' for unbounded integers"
        )


class MicrobatchMeanAccumulator:
    """Microbatch mean fed k microbatches at a time: float64 sums on the values' device, divided by M.

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.

    >>> acc = MicrobatchMeanAccumulator()
    >>> acc.update(torch.tensor([[1.0, 2.0]]), torch.tensor([[True, False]]))
    >>> acc.update(torch.tensor([[3.0, 4.0]]))
    >>> acc.result().tolist()
    [2.0, 2.0]
    """

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        _checks.check_nonfinite_option(nonfinite)
        self._nonfinite = nonfinite
        self._via_numpy: numpy_backend.MicrobatchMeanAccumulator | None = None
        self._sums: Any = None
        self._m = 0  # the divisor: microbatches counted, nothing else

    def update(self, values: Any, present: Any = None) -> None:
        """Add k microbatches: ``values`` ``(k, P)`` and ``present`` ``(k, P)`` booleans (None = all).

        Args:
            values: as for :func:`microbatch_mean`.
            present: as for :func:`microbatch_mean`.

        Raises:
            GradaggError: see :func:`microbatch_mean`.
        """
        v = _numeric_tensor(values, "values")
        if self._via_numpy is not None or (self._sums is None and CPU_VIA_NUMPY and v.device.type == "cpu"):
            if self._via_numpy is None:
                self._via_numpy = numpy_backend.MicrobatchMeanAccumulator(nonfinite=self._nonfinite)
            self._via_numpy.update(_host(v), None if present is None else _host(as_tensor(present)))
            return
        mask = _check_values(v, None if present is None else as_tensor(present, v.device))
        if self._nonfinite == "raise":
            _checks.check_finite_values(v.cpu().numpy(), None if mask is None else mask.cpu().numpy(), self._m)
        if self._sums is None:
            self._sums = torch.zeros(v.shape[1], dtype=torch.float64, device=v.device)
        elif v.shape[1] != len(self._sums):
            raise RowShapeError(
                f"microbatch {self._m}: has {v.shape[1]} values, expected {len(self._sums)} (from microbatch 0)"
            )
        for i in range(v.shape[0]):
            row = v[i].to(torch.float64, copy=True)  # a copy: masked_fill_ below must not touch the input
            self._sums += row if mask is None else row.masked_fill_(~mask[i], 0.0)
        self._m += v.shape[0]

    def result(self) -> Any:
        """Return the ``(P,)`` float64 means (empty when no microbatch was fed).

        Returns:
            As for :func:`microbatch_mean`.
        """
        if self._via_numpy is not None:
            return torch.from_numpy(self._via_numpy.result())
        if self._sums is None or self._m == 0:
            return torch.empty(0, dtype=torch.float64)
        return self._sums / self._m


def _check_values(v: Any, mask: Any) -> Any:
    if v.dim() != 2:
        raise RowShapeError(f"values must have shape (M, P) (M microbatches of P parameters), got {tuple(v.shape)}")
    if v.dtype == torch.bool or v.is_complex():
        raise GradientTypeError(f"values must be integers or floats, got {v.dtype}")
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise GradientTypeError(f"present must be a boolean mask (True = present), got {mask.dtype}")
    if mask.shape != v.shape:
        raise RowShapeError(f"present has shape {tuple(mask.shape)}, values have shape {tuple(v.shape)}")
    return mask


def _mean_of_lists(rows: Any, nonfinite: str) -> list[Any]:
    """Per parameter j: float64 sum of its present tensors over the M microbatches, divided by M."""
    m = len(rows)
    width = len(rows[0]) if m else 0
    out = []
    for j in range(width):
        total: Any = None
        first = 0
        for i, row in enumerate(rows):
            if len(row) != width:
                raise RowShapeError(f"microbatch {i}: has {len(row)} values, expected {width} (from microbatch 0)")
            if row[j] is None:
                continue  # absent: contributes zero, still counted in M
            value = as_tensor(row[j])
            if value.dtype == torch.bool or value.is_complex():
                raise GradientTypeError(f"microbatch {i}, parameter {j}: values must be numbers, got {value.dtype}")
            if nonfinite == "raise":
                _checks.check_finite_item(value.detach().cpu().numpy(), f"microbatch {i}, parameter {j}")
            if total is None:
                total, first = torch.zeros(value.shape, dtype=torch.float64, device=value.device), i
            elif value.shape != total.shape:
                raise GradientShapeError(
                    f"microbatch {i}, parameter {j}: shape {tuple(value.shape)}, expected {tuple(total.shape)} "
                    f"(from microbatch {first})"
                )
            total += value.to(torch.float64)
        out.append(torch.zeros((), dtype=torch.float64) if total is None else total / m)
    return out
