"""Which format an input or output is in, and an input's bytes (gradagg.rows.formats.detect)."""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradagg.errors import FormatError, GradaggError
from gradagg.options import FORMATS
from gradagg.rows.formats import detect

# --- formats and bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "contract", "fmt"),
    [
        (b"PAR1....PAR1", "owner-sum", "parquet"),
        (b"", "owner-sum", "csv"),
        (b"shard_id,worker_id,owner_id,gradient\n", "owner-sum", "csv"),
        (b"  \n [] ", "owner-sum", "json"),
        (b'\xef\xbb\xbf["x", 0, 0, 1]', "owner-sum", "jsonl"),
        (b'{"shard_id": "x"}', "owner-sum", "jsonl"),
        (b'{"rows": []}', "microbatch-mean", "json"),
        (b"[\n[1, 2]\n]", "microbatch-mean", "json"),
        (b"[1, 2]\n\n[3, 4]\n", "microbatch-mean", "jsonl"),
        (b"[1e999]\n[3]\n", "microbatch-mean", "jsonl"),  # a whole value, only a bad one: JSON Lines names it
        (b"[[1]]", "microbatch-mean", "json"),
        (b"[ {}", "owner-sum", "json"),
    ],
)
def test_sniff(data: bytes, contract: str, fmt: str) -> None:
    assert detect.sniff(data, contract) == fmt


def test_decode() -> None:
    assert detect.decode(b"\xef\xbb\xbfa", "x") == "a"
    with pytest.raises(FormatError, match=r"x: not UTF-8 text: byte 0xed at offset 3 \(line 2\)"):
        detect.decode(b"[]\n\xed\xa0\x80", "x")  # an encoded surrogate is not UTF-8
    with pytest.raises(FormatError, match=r"x: the input is empty \(0 bytes\)"):
        detect.decode(b"\xef\xbb\xbf", "x")


def test_one_table_of_formats() -> None:
    """--format's choices, the input extensions and the output extensions name the same formats."""
    assert sorted(set(detect.INPUT_FORMATS.values())) == sorted(FORMATS) == sorted(set(detect.OUTPUT_FORMATS.values()))


# --- reading, bounded ------------------------------------------------------------------------------------


class Trickle(io.RawIOBase):
    """A stream of unknown size that never ends (as /dev/zero), counting what was read from it."""

    def __init__(self) -> None:
        self.given = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), 4096)
        buffer[:n] = b" " * n
        self.given += n
        return n


def test_a_stream_is_read_up_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is half the memory allowed: 1 MB allowed, so the error comes past 500 kB, before 2 MiB more."""
    monkeypatch.setattr(detect, "memory_allowed", lambda: 1_000_000)
    stream = Trickle()
    with pytest.raises(FormatError, match=r"endless: holds more than 500,000 bytes \(read so far\)"):
        detect.read_bounded(io.BufferedReader(stream), "endless")  # type: ignore[arg-type]
    assert 500_000 < stream.given <= 500_000 + (2 << 20)


def test_a_known_size_is_checked_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detect, "memory_allowed", lambda: 1_000)
    stream = Trickle()
    with pytest.raises(FormatError, match="big.json: is 2,000 bytes; an input read into memory may take at most"):
        detect.read_bounded(io.BufferedReader(stream), "big.json", 2_000)  # type: ignore[arg-type]
    assert stream.given == 0


def test_a_regular_file_of_size_zero_is_still_read(tmp_path: Path) -> None:
    """Some files say 0 bytes and hold more (/proc): the size is where reading starts, not where it stops."""
    path = tmp_path / "x.json"
    path.write_bytes(b"[1]")
    with open(path, "rb") as f:
        assert detect.read_bounded(f, "x.json", 0) == b"[1]"  # type: ignore[arg-type]


def test_memory_allowed_follows_the_address_space_limit() -> None:
    """In a child process (a limit on this one would stay on every later test's allocations)."""
    code = ("import resource; from gradagg.rows.formats.detect import memory_allowed; "
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1])); "
            "print(memory_allowed())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 0 < int(out) <= 3 << 30


def test_a_fifo_without_extension_is_recognised_by_content(tmp_path: Path) -> None:
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(b'[["x", 0, 0, 1]]'), daemon=True)
    writer.start()
    source = detect.read_input(str(fifo), None, "owner-sum", None)
    writer.join(timeout=10)
    assert (source.fmt, source.text, source.sniffed) == ("json", '[["x", 0, 0, 1]]', True)


# --- which contract an input looks like ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "content", "contract"),
    [("json", '[["x", "a", "a", 1], [7, 0, 0, [1.5, 2]]]', "owner-sum"),
     ("jsonl", '{"shard_id": 1, "worker_id": 0, "owner_id": 0, "gradient": 1}\n', "owner-sum"),
     ("csv", "shard_id,worker_id,owner_id,gradient\n", "owner-sum"),
     ("json", '{"rows": [], "active_counts": []}', "microbatch-mean"),
     ("json", "[[1, null], [2, 3]]", "microbatch-mean"),
     ("jsonl", "[1, null]\n[2, 3]\n", "microbatch-mean"),
     ("csv", "a,b\n1,\n-2.5e3,nan\n", "microbatch-mean"),
     ("json", "[[1, 0, 0, 2]]", None),           # both: either contract reads it
     ("json", "[[1, 2], [3]]", None),            # ragged: neither
     ("json", '[["x", "a", "a", "lots"]]', None),  # a bad gradient: a bad owner-sum input, not a mean one
     ("json", "[", None),                        # not JSON at all
     ("csv", "a,b\nx,1\n", None)],
)
def test_contract_of(fmt: str, content: str, contract: str | None) -> None:
    assert detect.contract_of(detect.Input(fmt, "in", content, None, False)) == contract


def test_named_errors_name_the_input_once() -> None:
    source = detect.Input("json", "r.json", '[["x", "a", "a"]]', None, False)
    for raised, shown in (("row 0: expected 4 fields", "r.json: row 0: expected 4 fields"),
                          ("r.json: line 1: invalid JSON", "r.json: line 1: invalid JSON")):
        with pytest.raises(GradaggError) as info, detect.named_errors(source, "owner-sum"):
            raise GradaggError(raised)
        assert str(info.value) == shown


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(at=st.integers(0, 200), fmt=st.sampled_from(["json", "jsonl"]), chunk=st.integers(1, 40))
def test_json_read_up_to_a_nul_fails_as_the_whole_input(at: int, fmt: str, chunk: int) -> None:
    """A NUL byte is never valid JSON: reading a stream stops at the first one (so /dev/zero ends at once), and
    the reader's error on what was read is its error on the whole (UTF-8) input. Multibyte characters around
    the NUL check that the cut never splits one."""
    from gradagg.rows.formats import text

    rows = [["x\u00e9\u20ac", 0, 0, [1.5, -2]], ["y", "a", "a", 3]] * 4
    dumps = functools.partial(json.dumps, ensure_ascii=False)
    body = (dumps(rows, indent=1) if fmt == "json" else "".join(dumps(r) + "\n" for r in rows)).encode()
    data = body[:at] + b"\0" + body[at:] + b"\0" * 5000
    original = detect._CHUNK
    detect._CHUNK = chunk  # (the module's read size: small, so that the stop cuts the input short)
    try:
        read = detect.read_bounded(io.BytesIO(data), "s", json_text=True)  # type: ignore[arg-type]
    finally:
        detect._CHUNK = original
    assert len(read) == data.index(b"\0") + 1

    def error(raw: bytes) -> str:
        with pytest.raises(FormatError) as info:
            text.read_owner_rows(detect.decode(raw, "s"), fmt, "s")
        return str(info.value)

    assert error(read) == error(data)
