"""Atomic output: a result file appears whole or not at all.

Every writer of gradagg (JSON, CSV, Parquet, the demo's plot) writes through
:func:`atomic_path`: a temporary file beside the target, then a rename, so a
failure at any point (an error, Ctrl-C, a SIGTERM the command line turns into
an exception) leaves the target as it was (absent or old) and no temporary
file behind. What the target is decides how it is written:

* absent, or a regular file: replaced atomically (its permission bits kept);
* a symbolic link: its target is replaced, the link itself stays;
* a FIFO or a character device (``/dev/null``, ``/dev/stdout``): written in
  place, since there is nothing to replace (the data streams through);
* a directory, a block device, a socket: refused with :class:`OutputError`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
from collections.abc import Iterator

from gradagg.errors import OutputError

# Signals that end the command line (it turns them into exceptions): blocked while a temporary file is
# created or removed, so that the file's name is always known to the code that removes it.
_DEFERRED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` all at once (see :func:`atomic_path` for what ``path`` may be).

    Args:
        path: the output file.
        data: the whole content.

    Raises:
        OutputError: ``path`` is a directory or another kind of file that cannot be written, its folder
            is missing or not writable, the disk is full: named after ``path`` (nothing is left behind).

    >>> import os, tempfile
    >>> out = os.path.join(tempfile.mkdtemp(), "result.json")
    >>> write_atomic(out, b"[]\\n"); open(out).read()
    '[]\\n'
    """
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                os.fsync(f.fileno())  # the rename must not reach the disk before the data
    except BrokenPipeError:
        raise  # a FIFO whose reader left: as a closed standard output, not an error of the result
    except OSError as exc:  # the temporary file's name, or none (a full device), would not tell the user which
        raise OutputError(f"{path}: cannot write the result: {exc.strerror or exc}") from None


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield the path to write; on success it becomes ``path``, on any failure nothing changes.

    Args:
        path: the output file.

    Yields:
        A temporary file's path beside the file ``path`` names, or ``path``
        itself when that is a FIFO or a character device (written in place).

    Raises:
        OutputError: ``path`` is a directory, a block device or a socket.

    >>> import os, tempfile
    >>> out = os.path.join(tempfile.mkdtemp(), "result.txt")
    >>> with atomic_path(out) as tmp:
    ...     _ = open(tmp, "w").write("done")
    >>> open(out).read()
    'done'
    """
    target, in_place = check_target(path)
    if in_place:
        yield target
        return
    mode = _mode_of(target)
    tmp = None
    try:
        with _signals_deferred():
            fd, tmp = _mkstemp(path, os.path.dirname(target))
        os.close(fd)
        os.chmod(tmp, mode)
        yield tmp
        os.replace(tmp, target)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        with _signals_deferred(), contextlib.suppress(FileNotFoundError):
            if tmp is not None:
                os.unlink(tmp)
        raise


def check_target(path: str) -> tuple[str, bool]:
    """Where writing ``path`` goes, and whether in place; refuse what cannot be written.

    Called by the command line before any work starts, so that a bad ``-o``
    fails at once, and again by :func:`atomic_path` when it writes.

    Args:
        path: the output file.

    Returns:
        ``(target, in_place)``: the file to replace (a symbolic link's target,
        resolved) and False, or ``path`` itself and True for a FIFO or a
        character device.

    Raises:
        OutputError: ``path`` is a directory, a block device or a socket, or its folder does not exist.

    >>> check_target("/dev/null")
    ('/dev/null', True)
    """
    try:
        mode = os.stat(path).st_mode  # follows symbolic links: the kind of file that would be written
    except FileNotFoundError:
        mode = None
    if mode is not None and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        return path, True
    if mode is not None and stat.S_ISDIR(mode):
        raise OutputError(f"{path}: is a directory; -o needs a file name")
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputError(f"{path}: is neither a regular file, a FIFO nor a character device; refusing to replace it")
    target = os.path.realpath(path)  # a symbolic link: replace what it points to, and keep the link
    if not os.path.isdir(os.path.dirname(target)):
        raise OutputError(f"{path}: the folder {os.path.dirname(target)} does not exist")
    return target, False


def _mkstemp(path: str, directory: str) -> tuple[int, str]:
    try:
        return tempfile.mkstemp(prefix=".gradagg-", suffix=".tmp", dir=directory)
    except OSError as exc:  # named after the output, not after a temporary file the user never asked for
        raise OutputError(f"{path}: cannot create a file in {directory}: {exc.strerror or exc}") from None


def _mode_of(target: str) -> int:
    """The permission bits the result gets: the old file's, else the usual ones (mkstemp makes 0600)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold back SIGINT, SIGTERM and SIGHUP for the few statements inside (where the OS offers it)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
