"""Produce the next item of an iterator on a thread while the caller works on this one (standard library only)."""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator
from queue import Full, Queue
from typing import Any, TypeVar

T = TypeVar("T")


def read_ahead(items: Iterator[T], depth: int = 1) -> Generator[T, None, None]:
    """The same items, produced on a thread while the caller handles the previous one.

    The producers here (pyarrow, the native page decoder) and the consumers
    (the engines' kernels) release the GIL, so on two cores reading and
    reducing overlap. At most ``depth`` items wait in the queue, so memory stays
    bounded (one waiting, one being produced, one being consumed). An exception
    while producing is raised here, in the caller's thread; a caller that stops
    early stops the thread too.

    Args:
        items: the iterator, consumed on the thread.
        depth: how many produced items may wait.

    Yields:
        The items, in order.

    >>> list(read_ahead(iter([1, 2, 3])))
    [1, 2, 3]
    """
    queue: Queue[tuple[str, Any]] = Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if not _put(queue, stop, ("item", item)):
                    return  # the caller stopped early (an error in its reduction)
            _put(queue, stop, ("end", None))
        except BaseException as exc:  # handed to the caller, who re-raises it
            _put(queue, stop, ("error", exc))

    thread = threading.Thread(target=produce, name="gradagg-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        thread.join()


def _put(queue: Queue[tuple[str, Any]], stop: threading.Event, item: tuple[str, Any]) -> bool:
    """Put ``item`` unless ``stop`` is set first; polls so that a stopped caller never leaves the thread blocked."""
    while not stop.is_set():
        try:
            queue.put(item, timeout=0.05)
            return True
        except Full:
            continue
    return False
