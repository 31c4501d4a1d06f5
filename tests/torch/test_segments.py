"""A microbatch's sequences (gradagg.torch.modes.segments) against a plain Python walk over its tokens (issue 36).

Packed rows whose positions do not start at 0 (a continuation of the previous microbatch's sequence, a
context-parallel shard) still start a sequence at their first token; a 0 in the positions starts one mid-row;
``cu_seqlens`` cut the flattened tokens, empty sequences included. The seeded draws count the classes they
reach and assert each was reached.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from gradagg.errors import GradaggError
from gradagg.torch.modes import Mode, aggregate
from gradagg.torch.modes.segments import check_loss, segments

SEGMENT_SEED = 3637  # the layouts below are drawn from it
LAYOUTS = 200
CLASSES = (
    "row starts at a position other than 0", "a 0 mid-row", "a sequence with no valid token", "an empty cu_seqlens "
    "sequence", "1-D", "rows without boundaries", "position_ids", "cu_seqlens",
)


def python_segments(
    mask: list[list[bool]], positions: list[list[int]] | None, cu: list[int] | None
) -> tuple[list[int], list[int]]:
    """Plain Python: each token's sequence (row by row) and each sequence's valid tokens."""
    index: list[int] = []
    if cu is not None:
        for s in range(len(cu) - 1):
            index += [s] * (cu[s + 1] - cu[s])
        count = len(cu) - 1
    else:
        count = 0
        for r, row in enumerate(mask):
            for t in range(len(row)):
                if t == 0 or (positions is not None and positions[r][t] == 0):
                    count += 1
                index.append(count - 1)
    flat = [m for row in mask for m in row]
    tokens = [0] * count
    for s, valid in zip(index, flat):
        tokens[s] += int(valid)
    return index, tokens


def _positions(rng: random.Random, width: int) -> list[int]:
    """A packed row's positions: it may start mid-sequence (at 1..9) and restart at 0 anywhere after."""
    pos = [0 if rng.random() < 0.5 else rng.randint(1, 9)]
    for _ in range(width - 1):
        pos.append(0 if rng.random() < 0.25 else pos[-1] + 1)
    return pos


def _cuts(rng: random.Random, n: int) -> list[int]:
    inner = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 4)))
    return [0, *inner, n]


def draw(rng: random.Random) -> tuple[list[list[bool]], bool, str, list[list[int]] | None, list[int] | None]:
    flat, width = rng.random() < 0.25, rng.randint(1, 6)
    mask = [[rng.random() < 0.6 for _ in range(width)] for _ in range(1 if flat else rng.randint(1, 3))]
    style = rng.choice(["rows", "position_ids", "cu_seqlens"])
    positions = [_positions(rng, width) for _ in mask] if style == "position_ids" else None
    cu = _cuts(rng, sum(len(row) for row in mask)) if style == "cu_seqlens" else None
    return mask, flat, style, positions, cu


def classes(mask: list[list[bool]], flat: bool, style: str, positions: list[list[int]] | None,
            cu: list[int] | None, tokens: list[int]) -> set[str]:
    hits = {
        "row starts at a position other than 0": positions is not None and any(p[0] != 0 for p in positions),
        "a 0 mid-row": positions is not None and any(0 in p[1:] for p in positions),
        "a sequence with no valid token": 0 in tokens,
        "an empty cu_seqlens sequence": cu is not None and any(a == b for a, b in zip(cu, cu[1:])),
        "1-D": flat,
        "rows without boundaries": style == "rows" and not flat,
        "position_ids": style == "position_ids",
        "cu_seqlens": style == "cu_seqlens",
    }
    return {name for name, hit in hits.items() if hit}


def test_a_packed_row_starts_a_sequence_whatever_its_first_position() -> None:
    """Rows continuing sequences (positions 0, 1 then 2, 3): two sequences of 2 tokens, not one of 4; the
    sequence mean is over both."""
    mask = torch.ones(2, 2, dtype=torch.bool)
    seg = segments(mask, position_ids=torch.tensor([[0, 1], [2, 3]]))
    assert (seg.count, seg.tokens.tolist(), seg.index.tolist()) == (2, [2, 2], [0, 0, 1, 1])
    part = aggregate(Mode.SEQ_MEAN_TOKEN_MEAN, torch.tensor([[1.0, 2.0], [4.0, 8.0]]), mask,
                     position_ids=torch.tensor([[5, 6], [7, 0]]))
    assert (float(part.loss), float(part.weight)) == (1.5 + 4.0 + 8.0, 3.0)


def test_segments_match_a_python_walk_over_the_tokens() -> None:
    """Seeded layouts (SEGMENT_SEED): the sequence of each token, the count and each sequence's valid tokens equal
    the Python walk's, and each sequence's sum of losses too (integer losses: exact); every class reached."""
    rng, reached = random.Random(SEGMENT_SEED), Counter[str]()
    for k in range(LAYOUTS):
        mask, flat, style, positions, cu = draw(rng)
        index, tokens = python_segments(mask, positions, cu)
        reached.update(classes(mask, flat, style, positions, cu, tokens))
        shape = (-1,) if flat else (len(mask), -1)
        kwargs = {}
        if positions is not None:
            kwargs["position_ids"] = torch.tensor(positions).reshape(shape)
        if cu is not None:
            kwargs["cu_seqlens"] = torch.tensor(cu)
        seg = segments(torch.tensor(mask).reshape(shape), **kwargs)
        where = (SEGMENT_SEED, k, mask, style, positions, cu)
        assert (seg.count, seg.index.tolist(), seg.tokens.tolist()) == (len(tokens), index, tokens), where
        losses = [float(rng.randint(1, 9)) for _ in index]
        flat_mask = [m for row in mask for m in row]
        want = [0.0] * len(tokens)
        for s, v, m in zip(index, losses, flat_mask):
            want[s] += v if m else 0.0
        assert seg.sums(torch.tensor(losses, dtype=torch.float64).reshape(shape)).tolist() == want, where
    assert all(reached[c] > 0 for c in CLASSES), reached


def test_cu_seqlens_as_a_list_a_float_or_a_2d_tensor_and_their_refusals() -> None:
    """The offsets as flash-attention and collators give them: a list, a float tensor, a (1, n) tensor; offsets
    that do not rise from 0 to the tokens are refused, naming the microbatch; so are a bad mask and a loss of
    another dtype or type."""
    mask = torch.ones(5, dtype=torch.bool)
    for cu in ([0, 2, 5], torch.tensor([0.0, 2.0, 5.0]), torch.tensor([[0, 2, 5]])):
        seg = segments(mask, cu_seqlens=cu)  # type: ignore[arg-type]
        assert (seg.count, seg.index.tolist(), seg.tokens.tolist()) == (2, [0, 0, 1, 1, 1], [2, 3]), cu
    for bad in ([0, 3, 2, 5], [1, 2, 5], [0, 2, 4], [0, 2.5, 5]):
        with pytest.raises(GradaggError, match=r"^microbatch 4: cu_seqlens .* must rise from 0 to the 5 tokens"):
            segments(mask, cu_seqlens=torch.tensor(bad), where="microbatch 4")
    with pytest.raises(GradaggError, match=r"^microbatch: mask\[1\] is 2"):
        segments(torch.tensor([1, 2]))
    seg = segments(mask)
    for loss, got in ((torch.ones(5, dtype=torch.long), "torch.int64 tensor"), ([1.0] * 5, "list")):
        with pytest.raises(GradaggError, match=f"^here: the token loss must be a floating-point tensor, got {got}$"):
            check_loss(loss, seg, "here")  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
def test_a_microbatch_with_no_tokens_has_no_sequence(shape: tuple[int, ...]) -> None:
    """An empty mask (no tokens) holds no sequence, whatever its shape (a (T,) mask of 0 tokens raised IndexError,
    a (B, 0) one a RuntimeError); with position_ids of its shape too."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for kw in ({}, {"position_ids": torch.zeros(shape, dtype=torch.long)}):
        seg = segments(mask, **kw)
        assert seg.count == 0 and seg.tokens.numel() == 0 and seg.index.numel() == 0, (shape, kw, seg)
