"""The command line, through a real subprocess: every format, -o, stdin, and every error class."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def gradagg(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradagg", *args], input=stdin, capture_output=True, text=True, cwd=cwd
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert proc.stderr.startswith("gradagg: error:") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert fragment in proc.stderr, proc.stderr


# --- owner-sum: every format ---------------------------------------------------------

DOC_ROWS = [["x", "a", "a", 1], ["x", "b", "a", 9], ["y", "c", "c", 2]]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_owner_sum_json(tmp_path: Path) -> None:
    proc = gradagg("owner-sum", str(write(tmp_path, "rows.json", json.dumps(DOC_ROWS))))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == '[["x", 1], ["y", 2]]\n'


def test_owner_sum_jsonl_arrays_and_objects(tmp_path: Path) -> None:
    lines = [
        json.dumps(DOC_ROWS[0]),
        "",
        json.dumps(dict(zip(["shard_id", "worker_id", "owner_id", "gradient"], DOC_ROWS[1]))),
        json.dumps(DOC_ROWS[2]),
    ]
    proc = gradagg("owner-sum", str(write(tmp_path, "rows.jsonl", "\n".join(lines) + "\n")))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [["x", 1], ["y", 2]]


def test_owner_sum_csv_with_int_ids_and_vector_cells(tmp_path: Path) -> None:
    """Canonical integer ids become ints, so 2 sorts before 10; '007' stays a string id."""
    text = 'shard_id,worker_id,owner_id,gradient\n10,0,0,1.5\n2,1,1,"[1, 2]"\n10,1,0,100\n2,1,1,"[3, 4]"\n'
    proc = gradagg("owner-sum", str(write(tmp_path, "rows.csv", text)))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[2, [4, 6]], [10, 1.5]]


def test_owner_sum_stdin_with_format() -> None:
    proc = gradagg("owner-sum", "-", "--format", "json", stdin=json.dumps(DOC_ROWS))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [["x", 1], ["y", 2]]


def test_format_flag_overrides_extension(tmp_path: Path) -> None:
    path = write(tmp_path, "rows.txt", "\n".join(json.dumps(r) for r in DOC_ROWS))
    proc = gradagg("owner-sum", str(path), "--format", "jsonl")
    assert json.loads(proc.stdout) == [["x", 1], ["y", 2]]


@pytest.mark.parametrize("name", ["owner_rows.json", "owner_rows.jsonl", "owner_rows.csv"])
def test_examples_run(name: str) -> None:
    proc = gradagg("owner-sum", str(EXAMPLES / name))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)


# --- mean: every format ----------------------------------------------------------------


def test_mean_json_object_and_bare_array(tmp_path: Path) -> None:
    obj = {"rows": [[None, 2], [9, None], [3, 4]], "active_counts": [1, 1, 2]}
    proc = gradagg("mean", str(write(tmp_path, "m.json", json.dumps(obj))))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [4.0, 2.0]
    proc = gradagg("mean", str(write(tmp_path, "bare.json", json.dumps(obj["rows"]))))
    assert json.loads(proc.stdout) == [4.0, 2.0]


def test_mean_jsonl(tmp_path: Path) -> None:
    proc = gradagg("mean", str(write(tmp_path, "m.jsonl", "[2, null]\n[4, 6]\n")))
    assert json.loads(proc.stdout) == [3.0, 3.0]


def test_mean_csv_empty_cell_is_absent_with_and_without_header(tmp_path: Path) -> None:
    proc = gradagg("mean", str(write(tmp_path, "m.csv", "a,b\n2,\n4,6\n")))
    assert json.loads(proc.stdout) == [3.0, 3.0]
    proc = gradagg("mean", str(write(tmp_path, "n.csv", "2,\n4,6\n")))
    assert json.loads(proc.stdout) == [3.0, 3.0]


def test_mean_nan_propagates_by_default(tmp_path: Path) -> None:
    proc = gradagg("mean", str(write(tmp_path, "m.jsonl", "[NaN, 1]\n[1, null]\n")))
    assert proc.returncode == 0
    assert proc.stdout == "[NaN, 0.5]\n"


def test_empty_inputs(tmp_path: Path) -> None:
    assert gradagg("owner-sum", str(write(tmp_path, "e.json", "[]"))).stdout == "[]\n"
    assert gradagg("owner-sum", str(write(tmp_path, "e.csv", ""))).stdout == "[]\n"
    assert gradagg("mean", str(write(tmp_path, "e.jsonl", ""))).stdout == "[]\n"


# --- -o OUT --------------------------------------------------------------------------------


def test_output_json_and_csv(tmp_path: Path) -> None:
    src = str(write(tmp_path, "rows.json", json.dumps(DOC_ROWS)))
    out = tmp_path / "out.json"
    proc = gradagg("owner-sum", src, "-o", str(out))
    assert proc.returncode == 0 and proc.stdout == ""
    assert json.loads(out.read_text()) == [["x", 1], ["y", 2]]
    assert oct(out.stat().st_mode & 0o777) != oct(0o600), "the result should get the usual permissions"
    proc = gradagg("owner-sum", src, "-o", str(tmp_path / "out.csv"))
    assert (tmp_path / "out.csv").read_text() == "shard_id,total\nx,1\ny,2\n"


def test_output_leaves_no_temporary_files(tmp_path: Path) -> None:
    src = str(write(tmp_path, "rows.json", json.dumps(DOC_ROWS)))
    gradagg("owner-sum", src, "-o", str(tmp_path / "out.json"))
    assert sorted(os.listdir(tmp_path)) == ["out.json", "rows.json"]


def test_output_into_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    src = str(write(tmp_path, "rows.json", json.dumps(DOC_ROWS)))
    proc = gradagg("owner-sum", src, "-o", str(tmp_path / "nope" / "out.json"))
    assert_one_line_error(proc, "No such file or directory")


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
    ("invalid json", "rows.json", '[["x", "a", "a", 1]', "invalid JSON at line 1"),
    ("jsonl bad line", "rows.jsonl", '["x", "a", "a", 1]\n{oops\n', "line 2: invalid JSON"),
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
    ("json not an array", "rows.json", '{"rows": []}', "expected a JSON array of rows"),
    ("unknown extension", "rows.txt", "[]", "cannot tell the format"),
]


@pytest.mark.parametrize(("label", "name", "text", "fragment"), OWNER_ERRORS, ids=[c[0] for c in OWNER_ERRORS])
def test_owner_sum_errors(tmp_path: Path, label: str, name: str, text: str, fragment: str) -> None:
    out = tmp_path / "out.json"
    out.write_text("previous result\n")
    proc = gradagg("owner-sum", str(write(tmp_path, name, text)), "-o", str(out))
    assert_one_line_error(proc, fragment)
    assert out.read_text() == "previous result\n", "a failed run must leave OUT as it was"
    assert sorted(os.listdir(tmp_path)) == sorted([name, "out.json"]), "no temporary file left behind"


MEAN_ERRORS = [
    ("ragged microbatch", "m.json", '{"rows": [[1, 2], [3]]}', "microbatch 1: has 1 values, expected 2"),
    ("ragged csv", "m.csv", "1,2\n3\n", "microbatch 1: has 1 values, expected 2"),
    ("string value", "m.jsonl", '[1, "x"]\n', "microbatch 0, parameter 1: value must be a number"),
    ("bad csv value", "m.csv", "1,2\n3,x\n", "microbatch 1, parameter 1: expected a number or an empty cell"),
    ("extra json keys", "m.json", '{"rows": [], "weights": []}', "unexpected keys ['weights']"),
    ("bad active counts", "m.json", '{"rows": [[1]], "active_counts": [1.5]}', "active_counts[0] must be"),
]


@pytest.mark.parametrize(("label", "name", "text", "fragment"), MEAN_ERRORS, ids=[c[0] for c in MEAN_ERRORS])
def test_mean_errors(tmp_path: Path, label: str, name: str, text: str, fragment: str) -> None:
    proc = gradagg("mean", str(write(tmp_path, name, text)), "-o", str(tmp_path / "out.json"))
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "out.json").exists()


def test_nonfinite_raise(tmp_path: Path) -> None:
    proc = gradagg("owner-sum", str(write(tmp_path, "r.json", '[["x", 0, 0, NaN]]')), "--nonfinite", "raise")
    assert_one_line_error(proc, "row 0: gradient of shard 'x' is nan")
    proc = gradagg("mean", str(write(tmp_path, "m.jsonl", "[1, Infinity]\n")), "--nonfinite", "raise")
    assert_one_line_error(proc, "microbatch 0, parameter 1 is inf")


def test_missing_file() -> None:
    assert_one_line_error(gradagg("owner-sum", "/nonexistent/rows.json"), "/nonexistent/rows.json: No such file")


def test_stdin_needs_format() -> None:
    assert_one_line_error(gradagg("owner-sum", "-", stdin="[]"), "needs --format")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_bytes(b"\xff\xfe[]")
    assert_one_line_error(gradagg("owner-sum", str(path)), "not UTF-8")


@pytest.mark.parametrize("args", [[], ["owner-sum"], ["frobnicate"], ["owner-sum", "x.json", "--format", "xml"]])
def test_usage_errors_are_one_line(args: list[str]) -> None:
    proc = gradagg(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("gradagg: error:") and proc.stderr.count("\n") == 1, proc.stderr


def test_help_and_version() -> None:
    proc = gradagg("--help")
    assert proc.returncode == 0 and "owner-sum" in proc.stdout and "verify" in proc.stdout
    assert gradagg("--version").stdout.startswith("gradagg ")
