"""Layouts: how many microbatches of the window each rank runs (consecutive slices, in order).

A layout is a tuple of per-rank counts: ``(4,)`` is one process running the whole window of 4,
``(1, 3)`` two ranks, ``(0, 4)`` two ranks of which rank 0 runs none. Its counts must sum to the
window's length: every microbatch runs exactly once, somewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradagg.errors import GradaggError
from gradagg.parity.types import Layout

# Each rank is a process with its own torch and a gloo connection to every other one; parity worlds
# are small checks, and 8 ranks already cover every uneven split worth testing on one machine.
MAX_RANKS = 8


def parse_layout(text: str) -> Layout:
    """``"1,3"`` -> ``(1, 3)``.

    Args:
        text: per-rank microbatch counts separated by commas.

    Returns:
        The counts as a tuple.

    Raises:
        GradaggError: a count is not a non-negative integer, or there are more than ``MAX_RANKS`` ranks.

    >>> parse_layout("2,1,1")
    (2, 1, 1)
    """
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise GradaggError(f"layout {text!r}: expected microbatch counts per rank separated by commas, "
                           "e.g. 4 or 1,3") from None
    negative = [c for c in counts if c < 0]
    if negative:
        raise GradaggError(f"layout {text!r}: a rank cannot run {negative[0]} microbatches")
    if len(counts) > MAX_RANKS:
        raise GradaggError(f"layout {text!r} has {len(counts)} ranks; at most {MAX_RANKS} local processes "
                           "(each is a full torch process: more checks nothing new on one machine)")
    return counts


def check_layouts(layouts: Sequence[Layout], window: int) -> list[Layout]:
    """Check that every layout runs each of the ``window`` microbatches exactly once.

    Args:
        layouts: per-rank counts, one tuple per layout.
        window: the number of microbatches that ``microbatches()`` returned.

    Returns:
        The layouts, as a list, duplicates removed (first kept).

    Raises:
        GradaggError: a layout's counts do not sum to ``window``, has no rank or too many.

    >>> check_layouts([(1, 3), (4,), (1, 3)], 4)
    [(1, 3), (4,)]
    """
    kept: list[Layout] = []
    for layout in layouts:
        if not layout:
            raise GradaggError("a layout needs at least one rank")
        if len(layout) > MAX_RANKS:
            raise GradaggError(f"layout {format_layout(layout)} has {len(layout)} ranks; at most {MAX_RANKS}")
        if sum(layout) != window:
            raise GradaggError(f"layout {format_layout(layout)}: the counts sum to {sum(layout)}, but "
                               f"microbatches() returned {window} microbatches (every one must run exactly once)")
        if layout not in kept:
            kept.append(layout)
    return kept


def default_layouts(window: int) -> list[Layout]:
    """One process; the most even split on 2 ranks; an uneven one (1 and the rest, or 0 and all).

    Ranks get consecutive slices of the window, so they never see the same data: a test that feeds
    every rank the same data cannot tell a missing average from a right one.

    Args:
        window: the number of microbatches, at least 1.

    Returns:
        Three layouts (fewer when two coincide).

    >>> default_layouts(8)
    [(8,), (4, 4), (1, 7)]
    >>> default_layouts(2)
    [(2,), (1, 1), (0, 2)]
    """
    even = ((window + 1) // 2, window // 2)
    uneven = (1, window - 1) if window >= 3 else (0, window)
    return check_layouts([(window,), even, uneven], window)


def format_layout(layout: Layout) -> str:
    """``(1, 3)`` -> ``"1,3"``, the form the command line takes.

    >>> format_layout((0, 4))
    '0,4'
    """
    return ",".join(str(c) for c in layout)


def rank_slice(layout: Layout, rank: int) -> slice:
    """The consecutive slice of the window that ``rank`` runs.

    >>> rank_slice((1, 3), 1)
    slice(1, 4, None)
    """
    start = sum(layout[:rank])
    return slice(start, start + layout[rank])
