"""The progress line the command line draws on stderr for long Parquet inputs.

A reader calls it as ``progress(rows_done, rows_total)`` after every batch.
It is off when stderr is not a terminal (logs and pipes stay clean) or with
``--quiet``.
"""

from __future__ import annotations

import time
from typing import TextIO


class ProgressLine:
    """Rows done / total and the rate, redrawn in place on one stderr line with ``\\r``.

    The clock starts at the first report (after the imports and the first
    batch), nothing is drawn before ``delay`` more seconds, nor once the work is
    done, so short inputs never show it; it is redrawn at most every 0.1 s and
    erased at the end (an error message then starts on a clean line).
    """

    def __init__(self, stream: TextIO, delay: float = 0.5) -> None:
        self._stream = stream
        self._delay = delay
        self._start: tuple[float, int] | None = None  # (time, rows) of the first report
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self._start is None:
            self._start = (now, done)
        elapsed = now - self._start[0]
        if elapsed < self._delay or now - self._last < 0.1 or done >= total:
            return
        self._last = now
        rate = (done - self._start[1]) / elapsed if elapsed > 0 else 0.0
        self._stream.write(f"\rgradagg: {done:,} / {total:,} rows ({100 * done / total:.0f}%), "
                           f"{rate / 1e6:.2f} M rows/s")
        self._stream.flush()
        self._drawn = True

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._drawn:
            self._stream.write("\r\033[K")  # erase the line: the result or the error starts on a clean one
            self._stream.flush()


class NoProgress:
    """The progress line when it is off (--quiet, or stderr is not a terminal)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def progress_for(*, quiet: bool, stream: TextIO) -> ProgressLine | NoProgress:
    """A progress line on ``stream`` when it is a terminal and ``quiet`` is off; else none."""
    if quiet or not stream.isatty():
        return NoProgress()
    return ProgressLine(stream)
