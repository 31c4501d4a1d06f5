"""PyTorch backend: both contracts as torch ops on the tensors' device.

* owner-sum: ``owned = worker == owner``; the owner rows' shard ids are
  merged into the sorted keys with ``torch.unique(sorted=True,
  return_inverse=True)``; ``index_add_`` adds each row into a float64 (or
  int64) total that starts at ``-0.0``. On CPU ``index_add_`` adds in row
  order (bit-identical to the reference, tested); on CUDA it uses atomic adds
  in no fixed order, so a total may differ from the reference by at most
  ``2 * (n - 1) * 2**-53 * sum(|g|)`` over the shard's n owner rows.
* microbatch mean: one float64 sum per parameter, microbatch by microbatch
  (elementwise, so exact on every device), divided by M.

String shard ids cannot live in a tensor: a ``<U`` array is merged into sorted
``<U`` keys on the host (packed keys, :mod:`gradagg.rows.backends._factor`); other
string ids get integer codes (:mod:`gradagg.rows.backends._strings`, exact for
trailing NULs), sorted by the strings at the end. Only positions or codes go
to the device. This module never calls another backend: choosing one is
:mod:`gradagg.rows.engine`'s alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradagg.errors import (
    GradientShapeError,
    GradientTypeError,
    IdError,
    RowShapeError,
    UnorderableShardError,
    short_repr,
)
from gradagg.options import check_nonfinite
from gradagg.rows.backends import _checks, _factor, _strings


def owner_sum(
    shard_ids: Any, worker_ids: Any, owner_ids: Any, gradients: Any, *, nonfinite: str = "propagate"
) -> tuple[Any, Any]:
    """Owner-only shard reduction on tensors (see :func:`gradagg.rows.engine.owner_sum_columns`).

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
        GradaggError: see :func:`gradagg.rows.engine.owner_sum_columns`.

    >>> s, t = owner_sum(torch.tensor([3, 3, 1]), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 2]),
    ...                  torch.tensor([1.0, 9.0, 2.0]))
    >>> s.tolist(), t.tolist()
    ([1, 3], [2.0, 1.0])
    """
    acc = ColumnarOwnerSum(nonfinite=nonfinite)
    acc.update(shard_ids, worker_ids, owner_ids, gradients)
    return acc.result()


def microbatch_mean(
    values: Any, present: Any = None, *, nonfinite: str = "propagate", parameter_offset: int = 0
) -> Any:
    """Microbatch mean on tensors (see :func:`gradagg.rows.engine.microbatch_mean_columns`).

    Args:
        values: ``(M, P)`` tensor, or a list of M lists of P tensors (``None`` = absent).
        present: ``(M, P)`` bool tensor for tensor input; ``None`` = all present.
        nonfinite: ``"propagate"`` or ``"raise"``.
        parameter_offset: the number of the first parameter, in messages (a batch of a longer input).

    Returns:
        ``(P,)`` float64 tensor on the values' device, or a list of P float64 tensors.

    Raises:
        GradaggError: see :func:`gradagg.rows.engine.microbatch_mean_columns`.

    >>> microbatch_mean(torch.tensor([[2.0, 0.0], [4.0, 6.0]]), torch.tensor([[True, False], [True, True]])).tolist()
    [3.0, 3.0]
    """
    check_nonfinite(nonfinite)
    if isinstance(values, (list, tuple)):
        return _mean_of_lists(values, nonfinite)
    acc = ColumnarMean(nonfinite=nonfinite)
    acc._parameter_offset = parameter_offset
    acc.update(values, present)
    return acc.result()


class ColumnarOwnerSum:
    """Owner-sum fed in batches; memory grows with distinct shards.

    Summation order: each shard's owner gradients are added in the order fed
    (on CPU exactly; on CUDA, see the module notes for the bound).

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.

    >>> acc = ColumnarOwnerSum()
    >>> acc.update(torch.tensor([7]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1.5]))
    >>> acc.update(torch.tensor([7]), torch.tensor([1]), torch.tensor([1]), torch.tensor([2.0]))
    >>> [x.tolist() for x in acc.result()]
    [[7], [3.5]]
    """

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        self._nonfinite = check_nonfinite(nonfinite)
        self._rows = 0
        self._id_kind: str | None = None
        self._names = _strings.Interner()  # codes of string shard ids
        self._keys: Any = None  # sorted unique shard ids (or codes of string ids): an int64 tensor
        self._totals: Any = None

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
        shards, owned = self._validate(shard_ids, worker_ids, owner_ids, grads)
        if len(grads):
            self._accumulate(shards, owned, grads)
        self._rows += len(grads)

    def result(self) -> tuple[Any, Any]:
        """Return ``(shards, totals)`` over all rows fed so far, shards sorted ascending.

        Returns:
            As for :func:`owner_sum`.
        """
        keyed = self._id_kind in ("str", "object")  # ids held as Python keys, with integer codes on the device
        if self._keys is None:
            empty = np.empty(0, dtype=object) if keyed else torch.empty(0, dtype=torch.int64)
            empty = np.empty(0, dtype="<U1") if self._id_kind == "fixed" else empty
            return empty, torch.empty(0, dtype=torch.float64)
        if not keyed:
            return self._keys, self._totals  # integers, or the sorted <U keys of <U input
        codes = self._keys.cpu().numpy()
        order = self._names.order(codes)  # codes count first appearances: sort by the ids themselves
        device_order = torch.from_numpy(order).to(self._totals.device)
        return _strings.object_array(self._names.keys(codes[order])), self._totals[device_order]

    def _validate(self, shard_ids: Any, worker_ids: Any, owner_ids: Any, grads: Any) -> tuple[Any, Any]:
        device = grads.device
        shards, skind = _ids("shard_ids", shard_ids, self._rows)
        workers, wkind = _ids("worker_ids", worker_ids, self._rows)
        owners, okind = _ids("owner_ids", owner_ids, self._rows)
        if grads.dim() not in (1, 2):
            raise GradientShapeError(f"gradients must have shape (N,) or (N, D), got shape {tuple(grads.shape)}")
        if grads.dtype == torch.bool or grads.is_complex():
            raise GradientTypeError(f"gradients must be integers or floats, got {grads.dtype}")
        names = ("shard_ids", "worker_ids", "owner_ids", "gradients")
        _checks.check_lengths(dict(zip(names, (len(shards), len(workers), len(owners), len(grads)))))
        typed = isinstance(shard_ids, torch.Tensor) or getattr(shard_ids, "dtype", np.dtype(object)).kind != "O"
        if skind == "str" and isinstance(shards, np.ndarray) and shards.dtype.kind == "U":
            skind = "fixed"  # a <U array (it cannot hold trailing NULs): sorted and merged as packed keys on the host
        if len(grads) or typed:  # an empty list or object array says nothing about the id type
            shards, skind = self._consistent(shards, skind)
        if skind == "fixed":
            owned = _owned(workers, wkind, owners, okind, device)
            if self._nonfinite == "raise":
                self._raise_nonfinite(owned, grads, shards)
            return shards, owned
        codes = torch.from_numpy(self._names.codes(shards)) if skind != "int" else shards
        owned = _owned(workers, wkind, owners, okind, device)
        if self._nonfinite == "raise":
            self._raise_nonfinite(owned, grads, codes)
        return codes.to(device), owned

    def _consistent(self, shards: Any, kind: str) -> tuple[Any, str]:
        """Keep one id kind per accumulator: keyed ids (str, mixed) take later ints as keys; ints take only ints."""
        if self._id_kind is None or kind == self._id_kind:
            self._id_kind = self._id_kind or kind
            return shards, kind
        if self._id_kind == "fixed" and kind == "str":  # strings after a <U array: as <U, if it can hold them
            return _strings.as_fixed(shards, self._rows), "fixed"
        if self._id_kind == "int" and kind in ("str", "object", "fixed"):  # beyond int64, or strings: keys from now
            self._hold_as_keys()
        if self._id_kind == "fixed":
            said = {"fixed": "str (a <U array)", "object": "int and str"}
            raise UnorderableShardError(
                f"row {self._rows}: shard ids are {said.get(kind, kind)} in this batch but "
                f"{said.get(self._id_kind, self._id_kind)} in earlier rows; an accumulator that started on an "
                "integer column takes only integer ids, and one that started on a <U array only strings"
            )
        self._id_kind = "object"
        return (_strings.object_array(shards.tolist()) if kind == "int" else shards), "object"

    def _hold_as_keys(self) -> None:
        """Turn the integer keys into codes of the same ids (Python ints); the totals keep their rows."""
        if self._keys is not None:
            ids = _strings.object_array(self._keys.cpu().tolist())
            # Interned in ascending order, the codes are 0..k-1 in the keys' order: still sorted keys.
            self._keys = torch.from_numpy(self._names.codes(ids)).to(self._keys.device)
        self._id_kind = "object"

    def _raise_nonfinite(self, owned: Tensor, grads: Tensor, codes: Any) -> None:
        if not grads.is_floating_point() or bool(torch.isfinite(grads).all()):
            return  # the common case, decided on the device; the one locator runs on the host only on failure
        found = _checks.first_nonfinite(grads.detach().cpu().numpy(), owned.cpu().numpy())
        if found is None:
            return
        code = codes[found[0]]
        shard = self._names.key(int(code)) if self._id_kind in ("str", "object") else code.item()
        at = f" element {found[1]}" if len(found) == 2 else ""
        value = grads[found].item()
        raise _checks.nonfinite_error(f"row {self._rows + found[0]}: gradient of shard {short_repr(shard)}{at}", value)

    def _accumulate(self, shards: Any, owned: Tensor, grads: Tensor) -> None:
        dtype = torch.int64 if not grads.is_floating_point() else torch.float64
        rows = grads[owned].to(dtype)
        if dtype == torch.int64:
            held = int(self._totals.abs().max()) if self._totals is not None and self._totals.numel() else 0
            _checks.check_int_headroom(rows.cpu().numpy(), held)
        if self._keys is None:
            self._keys = shards[:0]
            self._totals = torch.empty((0, *grads.shape[1:]), dtype=dtype, device=grads.device)
        elif rows.shape[1:] != self._totals.shape[1:] or dtype != self._totals.dtype:
            raise GradientShapeError(
                f"row {self._rows}: gradients are {dtype} of shape {tuple(rows.shape[1:])}, expected "
                f"{self._totals.dtype} of shape {tuple(self._totals.shape[1:])} (from row 0)"
            )
        device = self._totals.device
        keys, old_pos, codes = _merge_keys(self._keys, shards, owned, device)
        # Old totals first, then this batch's rows in row order: -0.0 + t == t keeps every total's bits.
        start = -0.0 if dtype.is_floating_point else 0
        totals = torch.full((len(keys), *rows.shape[1:]), start, dtype=dtype, device=device)
        totals.index_add_(0, old_pos, self._totals)
        totals.index_add_(0, codes, rows.to(device))
        self._keys, self._totals = keys, totals


def _merge_keys(old: Any, shards: Any, owned: Any, device: Any) -> tuple[Any, Any, Any]:
    """Sorted union of the table's keys and the owner rows' ids; the positions of each old key and each new id.

    Integer ids (and codes) merge on the device with ``torch.unique``; ``<U`` ids on the host, as packed keys
    (:mod:`gradagg.rows.backends._factor`: no Python compare of strings), only their positions going to the device.
    """
    if isinstance(old, torch.Tensor):
        keys, inverse = torch.unique(torch.cat([old, shards[owned].to(device)]), sorted=True, return_inverse=True)
        return keys, inverse[: len(old)], inverse[len(old) :]
    keys, inv = _factor.factorize(np.concatenate([old, shards[owned.cpu().numpy()]]))
    inverse = torch.from_numpy(inv).to(device)
    return keys, inverse[: len(old)], inverse[len(old) :]


# Unsigned dtypes wider than uint8: ``.to(torch.int64)`` wraps uint64 past 2**63 - 1 (2**64 - 1 becomes -1), so
# they go through the host's checks, which widen them to int64 or refuse, naming the value, as the NumPy engine does.
_WIDE_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def _numeric_tensor(x: object, name: str) -> Tensor:
    """Numbers must come as a tensor: :mod:`gradagg.rows.engine` converts every other input kind.

    Raises:
        GradaggError: uint64 values beyond int64 (a fixed-width engine cannot sum them; python can).
    """
    if isinstance(x, torch.Tensor):
        if x.dtype in _WIDE_UNSIGNED:
            return torch.from_numpy(_checks.widen(x.detach().cpu().numpy(), name)).to(x.device)
        return x
    raise GradientTypeError(f"{name}: the torch backend takes tensors, got {type(x).__name__}; use gradagg.rows.engine")


def _ids(name: str, x: Any, offset: int) -> tuple[Any, str]:
    """Integer ids as an int64 tensor; string ids as a NumPy array on the host (``"str"``).

    Wide unsigned tensors are read on the host: a uint64 id past int64 is an exact Python key (``"object"``).
    """
    if isinstance(x, torch.Tensor) and x.dtype in _WIDE_UNSIGNED:
        x = x.detach().cpu().numpy()
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise RowShapeError(f"{name} must be one-dimensional (one id per row), got shape {tuple(x.shape)}")
        if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            raise IdError(f"{name} must hold int or str ids, got a {x.dtype} tensor")
        return x.to(torch.int64), "int"
    ids, kind = _checks.as_ids(name, x, offset)
    return (ids, kind) if kind != "int" else (torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), kind)


def _owned(workers: Any, worker_kind: str, owners: Any, owner_kind: str, device: torch.device) -> Tensor:
    """The owner-row mask as a bool tensor on ``device`` (anything but two int columns compared on the host)."""
    if worker_kind == owner_kind == "int":
        same_ids: Tensor = workers.to(device) == owners.to(device)
        return same_ids
    host = [x.cpu().numpy() if isinstance(x, torch.Tensor) else x for x in (workers, owners)]
    same = _checks.owner_rows(host[0], worker_kind, host[1], owner_kind)
    return torch.from_numpy(same).to(device)


class ColumnarMean:
    """Microbatch mean fed k microbatches at a time: float64 sums on the values' device, divided by M.

    Args:
        nonfinite: ``"propagate"`` or ``"raise"``.

    >>> acc = ColumnarMean()
    >>> acc.update(torch.tensor([[1.0, 2.0]]), torch.tensor([[True, False]]))
    >>> acc.update(torch.tensor([[3.0, 4.0]]))
    >>> acc.result().tolist()
    [2.0, 2.0]
    """

    def __init__(self, *, nonfinite: str = "propagate") -> None:
        self._nonfinite = check_nonfinite(nonfinite)
        self._parameter_offset = 0  # set by microbatch_mean for a batch of a longer input's parameters
        self._sums: Tensor | None = None
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
        mask = _check_values(v, None if present is None else _numeric_tensor(present, "present").to(v.device))
        if self._nonfinite == "raise" and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            # Decided on the device; the one locator runs on the host only when there is something to name.
            host_mask = None if mask is None else mask.cpu().numpy()
            _checks.check_finite_values(v.cpu().numpy(), host_mask, self._m, self._parameter_offset)
        kind = torch.float64 if v.is_floating_point() else torch.int64  # integers summed exactly, as the reference
        if self._sums is None:
            self._sums = torch.zeros(v.shape[1], dtype=kind, device=v.device)
        else:
            _checks.check_like_first_microbatch(self._m, v.shape[1], len(self._sums), kind == torch.int64,
                                                self._sums.dtype == torch.int64, str(v.dtype), str(self._sums.dtype))
        if kind == torch.int64:
            counted = v if mask is None else v[mask]
            _checks.check_int_headroom(counted.cpu().numpy(), int(self._sums.abs().max()) if len(self._sums) else 0)
        for i in range(v.shape[0]):
            row = v[i].to(kind, copy=True)  # a copy: masked_fill_ below must not touch the input
            self._sums += row if mask is None else row.masked_fill_(~mask[i], 0)
        self._m += v.shape[0]

    def result(self) -> Tensor:
        """Return the ``(P,)`` float64 means (empty when no microbatch was fed).

        Returns:
            As for :func:`microbatch_mean`.
        """
        if self._sums is None or self._m == 0:
            return torch.empty(0, dtype=torch.float64)
        return _means(self._sums, self._m)


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
            value = _numeric_tensor(row[j], f"microbatch {i}, parameter {j}")
            if value.dtype == torch.bool or value.is_complex():
                raise GradientTypeError(f"microbatch {i}, parameter {j}: values must be numbers, got {value.dtype}")
            if nonfinite == "raise" and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                _raise_nonfinite_item(value, f"microbatch {i}, parameter {j}")
            if total is None:
                kind = torch.float64 if value.is_floating_point() else torch.int64
                total, first = torch.zeros(value.shape, dtype=kind, device=value.device), i
            elif value.shape != total.shape:
                raise GradientShapeError(
                    f"microbatch {i}, parameter {j}: shape {tuple(value.shape)}, expected {tuple(total.shape)} "
                    f"(from microbatch {first})"
                )
            total = _add_item(total, value)
        out.append(torch.zeros((), dtype=torch.float64) if total is None else _means(total, m))
    return out


def _add_item(total: Tensor, value: Tensor) -> Tensor:
    """As the reference adds Python numbers: int64 while every value so far was an integer, then float64."""
    if total.dtype == torch.int64 and not value.is_floating_point():
        _checks.check_int_headroom(value.cpu().numpy(), int(total.abs().max()) if total.numel() else 0)
        return total + value.to(torch.int64)
    return total.to(torch.float64) + value.to(torch.float64)


def _means(sums: Tensor, m: int) -> Tensor:
    """``sums / m`` in float64; integer sums divided exactly as Python does (on the host: rare and small)."""
    if sums.is_floating_point():
        return sums / m
    return torch.from_numpy(np.asarray(_checks.exact_means(sums.cpu().numpy(), m))).to(sums.device)


def _raise_nonfinite_item(value: Tensor, where: str) -> None:
    flat = value.detach().cpu().numpy().reshape(-1)
    found = _checks.first_nonfinite(flat)
    if found is not None:
        raise _checks.nonfinite_error(f"{where}{f' element {found[0]}' if value.dim() else ''}", flat[found])
