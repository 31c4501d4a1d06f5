"""The command line: every text format, -o, stdin, and every error class (exit 2, one line, nothing half-written).

Most runs are in-process (the ``cli`` fixture, fast); those that check what only a
real process shows (the exit status of the program, stderr's exact bytes) use
``cli_process``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

DOC_ROWS = [["x", "a", "a", 1], ["x", "b", "a", 9], ["y", "c", "c", 2]]
Cli = Callable[..., Any]


def write(tmp_path: Path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


# --- owner-sum: every format ---------------------------------------------------------


def test_owner_sum_json(cli_process: Cli, tmp_path: Path) -> None:
    assert cli_process("owner-sum", write(tmp_path, "rows.json", json.dumps(DOC_ROWS))).ok() == '[["x", 1], ["y", 2]]\n'


def test_owner_sum_jsonl_arrays_and_objects(cli: Cli, tmp_path: Path) -> None:
    lines = [
        json.dumps(DOC_ROWS[0]),
        json.dumps(dict(zip(["shard_id", "worker_id", "owner_id", "gradient"], DOC_ROWS[1]))),
        json.dumps(DOC_ROWS[2]),
    ]
    assert json.loads(cli("owner-sum", write(tmp_path, "rows.jsonl", "\n".join(lines) + "\n")).ok()) == [
        ["x", 1], ["y", 2]]


def test_owner_sum_csv_with_int_ids_and_vector_cells(cli: Cli, tmp_path: Path) -> None:
    """Canonical integer ids become ints, so 2 sorts before 10; a vector gradient is a JSON array cell."""
    text = 'shard_id,worker_id,owner_id,gradient\n10,0,0,1.5\n2,1,1,"[1, 2]"\n10,1,0,100\n2,1,1,"[3, 4]"\n'
    assert json.loads(cli("owner-sum", write(tmp_path, "rows.csv", text)).ok()) == [[2, [4, 6]], [10, 1.5]]


def test_csv_ids_that_are_not_canonical_integers_stay_strings(cli: Cli, tmp_path: Path) -> None:
    """Worker '007' is not owner 7 and worker '-0' is not owner 0: those rows are replicas, only z counts."""
    text = "shard_id,worker_id,owner_id,gradient\nx,007,7,1\ny,-0,0,2\nz,0,0,3\n"
    assert json.loads(cli("owner-sum", write(tmp_path, "rows.csv", text)).ok()) == [["z", 3]]


def test_format_flag_overrides_extension(cli: Cli, tmp_path: Path) -> None:
    path = write(tmp_path, "rows.txt", "\n".join(json.dumps(r) for r in DOC_ROWS))
    assert json.loads(cli("owner-sum", path, "--format", "jsonl").ok()) == [["x", 1], ["y", 2]]


# --- mean: every format ----------------------------------------------------------------


def test_mean_json_object_and_bare_array(cli: Cli, tmp_path: Path) -> None:
    obj = {"rows": [[None, 2], [9, None], [3, 4]], "active_counts": [1, 1, 2]}
    assert json.loads(cli("mean", write(tmp_path, "m.json", json.dumps(obj))).ok()) == [4.0, 2.0]
    assert json.loads(cli("mean", write(tmp_path, "bare.json", json.dumps(obj["rows"]))).ok()) == [4.0, 2.0]


def test_mean_jsonl(cli: Cli, tmp_path: Path) -> None:
    assert json.loads(cli("mean", write(tmp_path, "m.jsonl", "[2, null]\n[4, 6]\n")).ok()) == [3.0, 3.0]


def test_mean_csv_empty_cell_is_absent_with_and_without_header(cli: Cli, tmp_path: Path) -> None:
    assert json.loads(cli("mean", write(tmp_path, "m.csv", "a,b\n2,\n4,6\n")).ok()) == [3.0, 3.0]
    assert json.loads(cli("mean", write(tmp_path, "n.csv", "2,\n4,6\n")).ok()) == [3.0, 3.0]


def test_mean_nan_propagates_by_default(cli: Cli, tmp_path: Path) -> None:
    assert cli("mean", write(tmp_path, "m.jsonl", "[NaN, 1]\n[1, null]\n")).ok() == "[NaN, 0.5]\n"


# --- CSV mean: the header and blank lines (issue 7: no line ever dropped or reinterpreted) ----------


def test_a_first_line_with_a_typo_is_an_error_not_a_header(cli: Cli, tmp_path: Path) -> None:
    """'1,abc' could be a header or a microbatch with a typo: taking it as a header lost a microbatch (M = 2)."""
    path = write(tmp_path, "m.csv", "1,abc\n2,3\n4,5\n")
    cli("mean", path).error("line 1: cannot tell a header from a microbatch: ['abc'] are not numbers but ['1']")
    cli("mean", path, "--no-header").error("line 1 (microbatch 0), parameter 1: expected a number or an empty cell")
    assert json.loads(cli("mean", path, "--header").ok()) == [3.0, 4.0]


def test_header_options(cli: Cli, tmp_path: Path) -> None:
    """A header of names is recognised; --header skips a line of numbers; --no-header reads it as a microbatch."""
    assert json.loads(cli("mean", write(tmp_path, "h.csv", "w0,w1\n2,4\n")).ok()) == [2.0, 4.0]
    numbers = write(tmp_path, "n.csv", "1,2\n3,5\n")
    assert json.loads(cli("mean", numbers, "--header").ok()) == [3.0, 5.0]
    assert json.loads(cli("mean", numbers, "--no-header").ok()) == [2.0, 3.5]
    cli("mean", write(tmp_path, "m.json", "[[1]]"), "--header").error("--header and --no-header apply to CSV")


def test_a_header_with_fewer_names_than_values_is_an_error(cli: Cli, tmp_path: Path) -> None:
    cli("mean", write(tmp_path, "m.csv", "a,b\n1,2,3\n")).error("line 2 (microbatch 0): 3 cells, expected 2")


def test_one_column_blank_line_is_an_absent_value(cli: Cli, tmp_path: Path) -> None:
    """1, absent, 3 over M = 3 (not over 2): a blank line in a one-column CSV is one empty cell."""
    assert json.loads(cli("mean", write(tmp_path, "m.csv", "1\n\n3\n")).ok()) == [4 / 3]
    assert json.loads(cli("mean", write(tmp_path, "h.csv", "g\n1\n\n3\n")).ok()) == [4 / 3]
    assert json.loads(cli("mean", write(tmp_path, "last.csv", "1\n3\n\n")).ok()) == [4 / 3]


def test_blank_line_in_a_wider_csv_is_an_error(cli: Cli, tmp_path: Path) -> None:
    cli("mean", write(tmp_path, "m.csv", "1,2\n\n3,4\n")).error(
        "line 2 (microbatch 1): a blank line, which is one empty cell; a microbatch whose parameters are all "
        "absent is written ','")
    cli("owner-sum", write(tmp_path, "o.csv", "shard_id,worker_id,owner_id,gradient\nx,a,a,1\n\n")).error(
        "line 3: expected 4 cells, got a blank line")


@pytest.mark.parametrize("contract", ["owner-sum", "mean"])
def test_blank_line_in_json_lines_is_an_error(cli: Cli, tmp_path: Path, contract: str) -> None:
    row = '["x", "a", "a", 1]' if contract == "owner-sum" else "[1, 2]"
    cli(contract, write(tmp_path, "m.jsonl", f"{row}\n\n{row}\n")).error("line 2: blank line; JSON Lines holds")


# --- numbers and structures Python cannot take as they come ------------------------------------------------

BIG = "1" + "0" * 400  # 10**400: an exact int, beyond any float
HUGE = "7" * 5000  # over Python's 4300-digit limit for int <-> text


@pytest.mark.parametrize(
    ("contract", "name", "content", "fragment"),
    [
        ("owner-sum", "r.json", f'[["x", 0, 0, {BIG}], ["x", 0, 0, 0.5]]', "row 1: adding gradient 0.5 to the total"),
        ("owner-sum", "r.csv", f"shard_id,worker_id,owner_id,gradient\nx,0,0,{BIG}\nx,0,0,0.5\n", "overflows a float"),
        ("mean", "m.json", f"[[{BIG}]]", "parameter 0: the sum <an int of about 401 digits> over M = 1"),
        ("mean", "m.csv", f"{BIG}\n0.5\n", "microbatch 1, parameter 0: adding 0.5 to the sum"),
        ("owner-sum", "r.json", f'[["x", 0, 0, {HUGE}]]', "line 1 column 14: an integer of 5000 digits"),
        ("owner-sum", "r.jsonl", f'["x", 0, 0, 1]\n["x", 0, 0, -{HUGE}]\n', "line 2 column 13: an integer of 5000"),
        ("owner-sum", "r.csv", f"shard_id,worker_id,owner_id,gradient\nx,0,0,{HUGE}\n", "line 2: gradient: an integer"),
        ("owner-sum", "r.csv", f"shard_id,worker_id,owner_id,gradient\n{HUGE},0,0,1\n", "line 2: shard_id: an integer"),
        ("mean", "m.csv", f"1\n{HUGE}\n", "line 2 (microbatch 1), parameter 0: an integer of 5000 digits"),
        ("owner-sum", "r.json", "[" * 100_000 + "]" * 100_000, "r.json: line 1: JSON nested too deeply"),
        ("mean", "m.jsonl", "[" * 100_000 + "]" * 100_000, "line 1: JSON nested too deeply"),
        ("owner-sum", "r.json", '[["x", 0, 0, 1e400]]', "line 1 column 14: number '1e400' is too large for a float"),
        ("mean", "m.csv", "1e400\n", "parameter 0: number '1e400' is too large for a float"),
        ("mean", "m.json", '{"rows": [[1]], "rows": [[2]]}', "an object has the key 'rows' twice"),
        ("owner-sum", "r.jsonl", '{"shard_id": "x", "shard_id": "y", "worker_id": 0, "owner_id": 0, "gradient": 1}\n',
         "line 1: an object has the key 'shard_id' twice"),
    ],
)
def test_numbers_and_nesting_beyond_python_are_one_line_errors(
    cli: Cli, tmp_path: Path, contract: str, name: str, content: str, fragment: str
) -> None:
    out = tmp_path / "out.json"
    out.write_text("previous\n")
    cli(contract, write(tmp_path, name, content), "-o", str(out)).error(fragment)
    assert out.read_text() == "previous\n"
    assert sorted(os.listdir(tmp_path)) == sorted([name, "out.json"])


def test_a_total_too_long_to_print_is_a_one_line_error(cli: Cli, tmp_path: Path) -> None:
    """Two 4300-digit integers (each readable) add up to 4301 digits, which Python will not write as text."""
    nines = "9" * 4300
    path = write(tmp_path, "r.json", f'[["x", 0, 0, {nines}], ["x", 0, 0, {nines}]]')
    cli("owner-sum", path).error("the total of shard 'x' is an integer of about 4301 digits")
    cli("owner-sum", path, "-o", str(tmp_path / "o.csv")).error("over Python's limit of 4300 digits for writing one")


def test_csv_cells_longer_than_the_csv_modules_limit_are_read(cli: Cli, tmp_path: Path) -> None:
    """A vector gradient of 20 000 elements is a ~200 KiB cell; the csv module stops at 128 KiB by default."""
    vector = [0.25] * 20_000
    text = "shard_id,worker_id,owner_id,gradient\n" + f'v,0,0,"{json.dumps(vector)}"\n' * 2
    assert json.loads(cli("owner-sum", write(tmp_path, "r.csv", text)).ok()) == [["v", [0.5] * 20_000]]
    long_id = "s" * 200_000
    text = f"shard_id,worker_id,owner_id,gradient\n{long_id},0,0,1\n"
    assert json.loads(cli("owner-sum", write(tmp_path, "i.csv", text)).ok()) == [[long_id, 1]]


def test_lone_surrogate_ids_are_escaped_in_json_and_refused_in_csv(cli: Cli, tmp_path: Path) -> None:
    """JSON may hold the escape \\ud800 (a lone surrogate); UTF-8 cannot, so CSV output refuses it."""
    path = write(tmp_path, "r.json", '[["\\ud800", 0, 0, 1]]')
    assert cli("owner-sum", path).ok() == '[["\\ud800", 1]]\n'
    assert cli("owner-sum", path, "-o", str(tmp_path / "o.json")).ok() == ""
    assert json.loads((tmp_path / "o.json").read_text()) == [["\ud800", 1]]
    cli("owner-sum", path, "-o", str(tmp_path / "o.csv")).error("line 2 holds the lone surrogate U+D800")
    assert not (tmp_path / "o.csv").exists()


def test_csv_output_quotes_line_breaks_and_commas(cli: Cli, tmp_path: Path) -> None:
    """An id with a carriage return, a comma or a quote survives a round trip through the CSV output."""
    ids = ["a\rb", "c,d", 'e"f', "g\nh"]
    path = write(tmp_path, "r.json", json.dumps([[s, 0, 0, 1] for s in ids]))
    assert cli("owner-sum", path, "-o", str(tmp_path / "o.csv")).ok() == ""
    import csv

    with open(tmp_path / "o.csv", newline="", encoding="utf-8") as f:
        assert list(csv.reader(f)) == [["shard_id", "total"]] + [[s, "1"] for s in sorted(ids)]


def test_space_around_a_csv_id_is_an_error(cli: Cli, tmp_path: Path) -> None:
    """'a' and ' a' would be two different workers, silently making an owner row a replica."""
    text = "shard_id,worker_id,owner_id,gradient\nx, a,a,1\n"
    cli("owner-sum", write(tmp_path, "r.csv", text)).error("line 2: worker_id ' a' has a space before or after it")


# --- -o OUT --------------------------------------------------------------------------------


def test_output_json_and_csv(cli: Cli, tmp_path: Path) -> None:
    src = write(tmp_path, "rows.json", json.dumps(DOC_ROWS))
    out = tmp_path / "out.json"
    assert cli("owner-sum", src, "-o", str(out)).ok() == ""
    assert json.loads(out.read_text()) == [["x", 1], ["y", 2]]
    assert out.stat().st_mode & 0o777 != 0o600, "the result should get the usual permissions"
    assert cli("owner-sum", src, "-o", str(tmp_path / "out.csv")).ok() == ""
    assert (tmp_path / "out.csv").read_text() == "shard_id,total\nx,1\ny,2\n"
    assert sorted(os.listdir(tmp_path)) == ["out.csv", "out.json", "rows.json"], "no temporary file left"


def test_output_into_missing_directory_is_a_clear_error(cli: Cli, tmp_path: Path) -> None:
    src = write(tmp_path, "rows.json", json.dumps(DOC_ROWS))
    cli("owner-sum", src, "-o", str(tmp_path / "nope" / "out.json")).error("the folder")


def test_output_onto_a_symbolic_link_writes_its_target(cli: Cli, tmp_path: Path) -> None:
    src = write(tmp_path, "rows.json", json.dumps(DOC_ROWS))
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old\n")
    link.symlink_to(target)
    assert cli("owner-sum", src, "-o", str(link)).ok() == ""
    assert link.is_symlink() and json.loads(target.read_text()) == [["x", 1], ["y", 2]]
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "new.json")
    assert cli("owner-sum", src, "-o", str(dangling)).ok() == ""
    assert dangling.is_symlink() and json.loads((tmp_path / "new.json").read_text()) == [["x", 1], ["y", 2]]


def test_output_onto_dev_null_writes_in_place(cli: Cli, tmp_path: Path) -> None:
    src = write(tmp_path, "rows.json", json.dumps(DOC_ROWS))
    assert cli("owner-sum", src, "-o", os.devnull).ok() == ""
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull), "the device node is still a device"


def test_output_onto_a_directory_is_refused_before_reading(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    cli("owner-sum", str(tmp_path / "missing.json"), "-o", str(tmp_path / "out")).error("is a directory")


# --- standard input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("contract", "content", "expected"),
    [
        ("owner-sum", json.dumps(DOC_ROWS), [["x", 1], ["y", 2]]),
        ("owner-sum", "".join(json.dumps(r) + "\n" for r in DOC_ROWS), [["x", 1], ["y", 2]]),
        ("owner-sum", json.dumps(DOC_ROWS[2]), [["y", 2]]),
        ("owner-sum", json.dumps(dict(zip(["shard_id", "worker_id", "owner_id", "gradient"], DOC_ROWS[2]))),
         [["y", 2]]),
        ("owner-sum", "shard_id,worker_id,owner_id,gradient\nx,a,a,1\n", [["x", 1]]),
        ("owner-sum", json.dumps(DOC_ROWS, indent=2), [["x", 1], ["y", 2]]),
        ("mean", '{"rows": [[2, null], [4, 6]]}', [3.0, 3.0]),
        ("mean", "[[2, null], [4, 6]]", [3.0, 3.0]),
        ("mean", "[2, null]\n[4, 6]\n", [3.0, 3.0]),
        ("mean", "[2, null]", [2.0, 0.0]),
        ("mean", "2,\n4,6\n", [3.0, 3.0]),
        ("mean", "\ufeff[[1]]", [1.0]),
    ],
)
def test_stdin_format_is_recognised_by_content(cli: Cli, contract: str, content: str, expected: list) -> None:
    assert json.loads(cli(contract, "-", stdin=content.encode()).ok()) == expected


def test_stdin_that_fails_as_recognised_says_which_option_to_add(cli: Cli) -> None:
    cli("owner-sum", "-", stdin=b'[["x", "a", "a", 1]').error(
        "(standard input was read as json, recognised by its content; pass --format jsonl or csv")


def test_closed_standard_streams(tmp_path: Path) -> None:
    """Standard input closed (``<&-``): '-' is a one-line error; standard output closed: the result needs -o."""
    import subprocess
    import sys

    path = write(tmp_path, "r.json", "[]")
    for args, closed, fragment in ((["-"], 0, "standard input is closed"), ([path], 1, "standard output is closed")):
        proc = subprocess.run([sys.executable, "-m", "gradagg", "owner-sum", *args], capture_output=True, text=True,
                              preexec_fn=lambda fd=closed: os.close(fd))  # type: ignore[misc]
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr


def test_stdin_with_format(cli_process: Cli) -> None:
    run = cli_process("owner-sum", "-", "--format", "jsonl", stdin=b'["x", "a", "a", 1]\n')
    assert json.loads(run.ok()) == [["x", 1]]


def test_stdin_parquet_is_recognised_by_its_magic_bytes(cli_process: Cli, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"mb0": pa.array([2.0, None]), "mb1": pa.array([4.0, 6.0])}), path)
    assert json.loads(cli_process("mean", "-", stdin=path.read_bytes()).ok()) == [3.0, 3.0]


# --- every error class: exit 2, one line, no traceback, no partial output ---------------------

OWNER_ERRORS = [
    ("wrong row length", "rows.json", '[["x", "a", "a", 1], ["x", "a", "a"]]', "row 1: expected 4 fields"),
    ("non-numeric gradient", "rows.jsonl", '["x", "a", "a", "lots"]\n', "row 0: gradient must be a number"),
    ("boolean gradient", "rows.json", '[["x", "a", "a", true]]', "got bool True"),
    (
        "vector lengths differ",
        "rows.jsonl",
        '["x", 0, 0, [1, 2]]\n["x", 1, 0, [1]]\n',
        "row 1: gradient of shard 'x' is a vector of length 1, expected a vector of length 2 (from row 0)",
    ),
    ("null shard id", "rows.json", '[[null, "a", "a", 1]]', "row 0: shard_id is missing"),
    ("empty owner cell", "rows.csv", "shard_id,worker_id,owner_id,gradient\nx,a,,1\n", "row 0: owner_id is missing"),
    ("unorderable shards", "rows.json", '[[1, 0, 0, 1], ["a", 0, 0, 2]]', "shard ids 1 (row 0, int) and 'a'"),
    ("invalid json", "rows.json", '[["x", "a", "a", 1]', "line 1 column 20: invalid JSON"),
    ("jsonl bad line", "rows.jsonl", '["x", "a", "a", 1]\n{oops\n', "line 2 column 2: invalid JSON"),
    (
        "jsonl object keys",
        "rows.jsonl",
        '{"shard_id": "x", "worker": "a", "owner_id": "a", "gradient": 1}\n',
        "line 1: object keys must be",
    ),
    ("csv header", "rows.csv", "shard,worker,owner,grad\nx,a,a,1\n", "line 1: CSV header must be"),
    ("csv cell count", "rows.csv", "shard_id,worker_id,owner_id,gradient\nx,a,a\n", "line 2: expected 4 cells"),
    (
        "csv gradient",
        "rows.csv",
        "shard_id,worker_id,owner_id,gradient\nx,a,a,abc\n",
        "line 2: gradient must be a number",
    ),
    ("csv quoting", "rows.csv", 'shard_id,worker_id,owner_id,gradient\n"x"y,a,a,1\n', "line 2: invalid CSV"),
    ("csv python-only number", "rows.csv", "shard_id,worker_id,owner_id,gradient\nx,a,a,1_000\n", "got '1_000'"),
    ("json not an array", "rows.json", '{"rows": []}', "expected a JSON array of rows"),
    ("unknown extension", "rows.txt", "[]", "cannot tell the format"),
    ("empty file", "rows.jsonl", "", "rows.jsonl: the input is empty (0 bytes)"),
    ("empty csv", "rows.csv", "", "the input is empty"),
    ("not utf-8", "rows.json", b"\xff\xfe[]", "rows.json: not UTF-8 text: byte 0xff at offset 0 (line 1)"),
]


@pytest.mark.parametrize(("label", "name", "text", "fragment"), OWNER_ERRORS, ids=[c[0] for c in OWNER_ERRORS])
def test_owner_sum_errors(cli: Cli, tmp_path: Path, label: str, name: str, text: str, fragment: str) -> None:
    out = tmp_path / "out.json"
    out.write_text("previous result\n")
    cli("owner-sum", write(tmp_path, name, text), "-o", str(out)).error(fragment)
    assert out.read_text() == "previous result\n", "a failed run must leave OUT as it was"
    assert sorted(os.listdir(tmp_path)) == sorted([name, "out.json"]), "no temporary file left behind"


MEAN_ERRORS = [
    ("ragged microbatch", "m.json", '{"rows": [[1, 2], [3]]}', "microbatch 1: has 1 values, expected 2"),
    ("ragged csv", "m.csv", "1,2\n3\n", "line 2 (microbatch 1): 1 cells, expected 2 (from line 1)"),
    ("string value", "m.jsonl", '[1, "x"]\n', "microbatch 0, parameter 1: value must be a number"),
    ("bad csv value", "m.csv", "1,2\n3,x\n", "line 2 (microbatch 1), parameter 1: expected a number or an empty"),
    ("extra json keys", "m.json", '{"rows": [], "weights": []}', "unexpected keys ['weights']"),
    ("bad active counts", "m.json", '{"rows": [[1]], "active_counts": [1.5]}', "active_counts[0] must be"),
]


@pytest.mark.parametrize(("label", "name", "text", "fragment"), MEAN_ERRORS, ids=[c[0] for c in MEAN_ERRORS])
def test_mean_errors(cli: Cli, tmp_path: Path, label: str, name: str, text: str, fragment: str) -> None:
    cli("mean", write(tmp_path, name, text), "-o", str(tmp_path / "out.json")).error(fragment)
    assert not (tmp_path / "out.json").exists()


def test_nonfinite_raise(cli: Cli, tmp_path: Path) -> None:
    path = write(tmp_path, "r.json", '[["x", 0, 0, NaN]]')
    cli("owner-sum", path, "--nonfinite", "raise").error("row 0: gradient of shard 'x' is nan")
    path = write(tmp_path, "m.jsonl", "[1, Infinity]\n")
    cli("mean", path, "--nonfinite", "raise").error("microbatch 0, parameter 1 is inf")


def test_files_that_cannot_be_read(cli_process: Cli, tmp_path: Path) -> None:
    """Through a real process: exactly one line on stderr and exit 2 for a missing file, a directory, an empty file."""
    cli_process("owner-sum", "/nonexistent/rows.json").error("/nonexistent/rows.json: No such file or directory")
    (tmp_path / "d.json").mkdir()
    cli_process("owner-sum", str(tmp_path / "d.json")).error("d.json: is a directory; FILE must be a file")
    cli_process("mean", write(tmp_path, "e.csv", "")).error("e.csv: the input is empty (0 bytes)")
    cli_process("mean", "-", stdin=b"").error("<stdin>: the input is empty (0 bytes)")


@pytest.mark.parametrize("args", [["owner-sum"], ["frobnicate"], ["owner-sum", "x.json", "--format", "xml"],
                                  ["verify", "--timeout", "0"]])
def test_usage_errors_are_one_line(cli_process: Cli, args: list[str]) -> None:
    cli_process(*args).error()


def test_no_arguments_lists_the_commands_and_fails(cli_process: Cli) -> None:
    """`gradagg` alone is a mistake (a script that lost its arguments must fail: exit 2), and the person who typed
    it wants to know what to type: the list of commands with a line each, on stderr, nothing on stdout."""
    run = cli_process()
    assert run.status == 2 and run.out == "" and "Traceback" not in run.err
    assert run.err.startswith("usage: gradagg ")
    for command in ("owner-sum", "mean", "verify", "demo", "parity"):
        assert f"    {command}" in run.err, run.err
    assert "sum each shard's gradient over its owner's rows only" in " ".join(run.err.split())


def test_help_and_version(cli_process: Cli) -> None:
    run = cli_process("--help")
    assert run.status == 0 and "owner-sum" in run.out and "verify" in run.out
    assert cli_process("--version").out.startswith("gradagg ")
    mean_help = " ".join(cli_process("mean", "--help").out.split())
    assert "--header, --no-header" in mean_help and "a blank line is one empty cell" in mean_help
