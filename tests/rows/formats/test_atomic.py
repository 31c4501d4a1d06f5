"""Atomic output: OUT appears whole or not at all, links and devices are respected, signals leave nothing behind."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gradagg.errors import OutputError
from gradagg.rows.formats.atomic import atomic_path, check_target, write_atomic


def test_a_failure_inside_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    out.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(str(out)) as tmp:
        Path(tmp).write_text("half")
        raise RuntimeError("the writer failed")
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


def test_the_old_files_permissions_are_kept(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    out.write_text("old")
    out.chmod(0o640)
    write_atomic(str(out), b"new")
    assert out.read_text() == "new" and stat.S_IMODE(out.stat().st_mode) == 0o640


def test_a_symbolic_link_keeps_pointing_at_its_replaced_target(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "out.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(str(link), b"new")
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "new"
    assert os.listdir(tmp_path / "real") == ["out.json"]


def test_a_fifo_is_written_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    write_atomic(str(fifo), b"[1]\n")
    reader.join(timeout=10)
    assert received == [b"[1]\n"] and stat.S_ISFIFO(fifo.lstat().st_mode)


def test_character_devices_are_written_in_place_and_stay_devices() -> None:
    assert check_target(os.devnull) == (os.devnull, True)
    write_atomic(os.devnull, b"discarded")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_what_cannot_be_replaced_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="is a directory"):
        check_target(str(tmp_path))
    with pytest.raises(OutputError, match="does not exist"):
        check_target(str(tmp_path / "missing" / "out.json"))
    sock = tmp_path / "s"
    import socket

    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    try:
        with pytest.raises(OutputError, match="is neither a regular file, a FIFO nor a character device"):
            check_target(str(sock))
    finally:
        server.close()


# --- signals: real processes --------------------------------------------------------------------------------


def _gradagg(args: list[str], **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "gradagg", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, **kw)  # type: ignore[call-overload]


def test_sigterm_while_reading_leaves_out_as_it_was(tmp_path: Path) -> None:
    """gradagg waits on a standard input that never ends; SIGTERM: exit 143, one line, OUT untouched."""
    out = tmp_path / "out.json"
    out.write_text("old\n")
    proc = _gradagg(["owner-sum", "-", "--format", "json", "-o", str(out)], stdin=subprocess.PIPE)
    time.sleep(1.0)  # let it start and block in the read
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and err == b"gradagg: stopped by SIGTERM\n"
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["out.json"]


# Runs the real command line, with the final rename made to wait (a line on stdout says the temporary file
# is written), so that the signal arrives exactly while the result sits in its temporary file.
# The child starts with the three signals at their defaults: a runner that ignores one (`nohup make test`
# ignores SIGHUP; a shell's background job ignores SIGINT) passes that on, and gradagg rightly keeps an
# ignored signal ignored, so the signal would never arrive.
_SLOW_RENAME = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
import gradagg.rows.formats.atomic as atomic
def slow_replace(src, dst):
    print("written", flush=True)
    time.sleep(60)
atomic.os.replace = slow_replace
from gradagg.cli import main
sys.argv = ["gradagg", *sys.argv[1:]]
sys.exit(main())
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_during_the_write_removes_the_temporary_file(tmp_path: Path, signum: int) -> None:
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([["x", "a", "a", 1]]))
    out = tmp_path / "out.json"
    out.write_text("old\n")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_RENAME, "owner-sum", str(rows), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"written\n"
    assert len(os.listdir(tmp_path)) == 3, "the temporary file exists while the rename waits"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum and err.count(b"\n") == 1, err
    assert out.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["out.json", "rows.json"]
