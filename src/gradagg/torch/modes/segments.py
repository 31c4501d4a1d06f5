"""One microbatch's sequences: a token loss and mask checked, packed rows unpacked by their boundaries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradagg.errors import GradaggError


@dataclass(frozen=True)
class Segments:
    """The sequences of one microbatch: ``index[t]`` is token t's sequence (tokens flattened row by row).

    Attributes:
        index: int64, one entry per token of the flattened microbatch.
        count: the number of sequences (fully masked ones included).
        mask: the valid tokens, bool, flattened.
        tokens: n_s, each sequence's valid tokens (int64, length ``count``).
        shape: the mask's shape, which the token loss must have.
    """

    index: torch.Tensor
    count: int
    mask: torch.Tensor
    tokens: torch.Tensor
    shape: tuple[int, ...]

    def sums(self, loss: torch.Tensor) -> torch.Tensor:
        """Each sequence's sum of valid token losses (a masked token's value is never read: NaN there is fine).

        ``index_add`` is differentiable in its source; on CUDA its float sum is not deterministic in order.
        """
        valid = torch.where(self.mask, loss.reshape(-1), torch.zeros((), dtype=loss.dtype, device=loss.device))
        return torch.zeros(self.count, dtype=loss.dtype, device=loss.device).index_add(0, self.index, valid)


def check_mask(mask: torch.Tensor, where: str) -> torch.Tensor:
    """The mask as bool: a bool tensor, or numbers that are all 0 or 1 (a fractional mask is not a count).

    Raises:
        GradaggError: a mask that is not a tensor, or holds a value other than 0 and 1.
    """
    if not isinstance(mask, torch.Tensor):
        raise GradaggError(f"{where}: the mask must be a tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise GradaggError(f"{where}: mask{list(at)} is {mask[at].item()}; a mask holds 0 and 1 only (or bool)")
    return mask != 0


def segments(
    mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    where: str = "microbatch",
) -> Segments:
    """Find the sequences of a microbatch of shape (T,) or (B, T).

    Without boundaries each row is one sequence. With ``position_ids`` (the mask's shape) a sequence also
    starts wherever the position is 0, as transformers packs rows; each row's first token always starts
    one. With ``cu_seqlens`` (flash-attention's offsets over the flattened tokens) sequence i is tokens
    ``cu_seqlens[i]`` to ``cu_seqlens[i + 1]``.

    Raises:
        GradaggError: a mask of another rank; both boundaries; boundaries of the wrong shape, or offsets that
            do not cover the tokens from 0 in non-decreasing order.
    """
    valid = check_mask(mask, where)
    if valid.dim() not in (1, 2):
        raise GradaggError(f"{where}: the mask has shape {tuple(valid.shape)}; expected (T,) or (B, T)")
    if position_ids is not None and cu_seqlens is not None:
        raise GradaggError(f"{where}: give position_ids or cu_seqlens, not both")
    rows = valid if valid.dim() == 2 else valid.reshape(1, -1)
    if cu_seqlens is not None:
        index, count = _from_offsets(cu_seqlens, valid.numel(), where)
    else:
        starts = torch.zeros_like(rows)
        if position_ids is not None:
            if tuple(position_ids.shape) != tuple(valid.shape):
                raise GradaggError(
                    f"{where}: position_ids has shape {tuple(position_ids.shape)}, the mask {tuple(valid.shape)}"
                )
            starts = position_ids.reshape(rows.shape) == 0
        if rows.shape[1]:  # (a row of no tokens starts no sequence)
            starts[:, 0] = True
        flat = starts.reshape(-1).long()
        index, count = flat.cumsum(0) - 1, int(flat.sum())
    flat_mask = valid.reshape(-1)
    index = index.to(valid.device)
    tokens = torch.zeros(count, dtype=torch.long, device=valid.device).index_add(0, index, flat_mask.long())
    return Segments(index.to(valid.device), count, flat_mask, tokens, tuple(valid.shape))


def _from_offsets(cu: torch.Tensor, n: int, where: str) -> tuple[torch.Tensor, int]:
    offsets = cu.reshape(-1).tolist() if isinstance(cu, torch.Tensor) else list(cu)
    if (
        not offsets
        or offsets[0] != 0
        or offsets[-1] != n
        or any(b < a for a, b in zip(offsets, offsets[1:]))
        or any(not float(o).is_integer() for o in offsets)
    ):
        raise GradaggError(
            f"{where}: cu_seqlens {offsets[:8]}{'...' if len(offsets) > 8 else ''} must rise from 0 to the "
            f"{n} tokens of the microbatch"
        )
    lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], dtype=torch.long)
    count = len(lengths)
    return torch.repeat_interleave(torch.arange(count), lengths), count


def check_loss(loss: torch.Tensor, seg: Segments, where: str) -> None:
    """The loss must be a floating tensor of the mask's shape.

    Raises:
        GradaggError: naming both shapes, or the dtype.
    """
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        got = f"{loss.dtype} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise GradaggError(f"{where}: the token loss must be a floating-point tensor, got {got}")
    if tuple(loss.shape) != seg.shape:
        raise GradaggError(f"{where}: the token loss has shape {tuple(loss.shape)}, the mask {seg.shape}")


__all__ = ["Segments", "check_loss", "check_mask", "segments"]
