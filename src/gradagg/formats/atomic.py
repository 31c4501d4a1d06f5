"""Atomic output: a result file appears whole or not at all.

Every writer of gradagg (JSON, CSV, Parquet, the demo's plot) writes through
:func:`atomic_path`: a temporary file beside the target, then a rename, so a
failure at any point leaves the target as it was (absent or old) and no
temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``data`` to ``path`` all at once: a temporary file, then a rename.

    A failure at any point leaves ``path`` as it was (absent or old) and no
    temporary file behind.
    """
    payload = data if isinstance(data, bytes) else data.encode("utf-8")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path beside ``path``; rename it over ``path`` on success only."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gradagg-", suffix=".tmp", dir=directory)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the result the usual permissions
    try:
        yield tmp
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
