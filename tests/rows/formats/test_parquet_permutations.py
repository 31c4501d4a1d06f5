"""Parquet footers whose lists are permuted, every chunk's path right: the true answer, or refused in one line.

Issue 30's class. A footer lists things in an order: the schema's columns, each
row group's column chunks, the row groups, the key-value metadata (the stored
Arrow schema among them), each chunk's encodings. A seeded draw permutes one of
those lists in a real file (:mod:`tests.rows.formats.parquet_footers`), never
rewriting a chunk's own path: what each chunk holds stays named by its path, so
the true answer stays the original file's, as pyarrow reads it by column name
(:mod:`gradagg.reference` over those rows). Every case must give that answer, bit
for bit, from the library and from the command line, or be refused: a one-line
:class:`~gradagg.errors.FormatError` naming the file, exit 2 with one line and
nothing on standard output. Values are small integers (floats that add exactly),
so an answer does not depend on the order the rows are read in.
"""

from __future__ import annotations

import base64
import copy
import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gradagg import reference  # noqa: E402  (after the importorskips)
from gradagg.errors import FormatError  # noqa: E402
from gradagg.rows.engine import microbatch_mean_batches, owner_sum_batches, python_values  # noqa: E402
from gradagg.rows.formats import parquet  # noqa: E402
from tests.rows.engine.engine_inputs import bits  # noqa: E402
from tests.rows.formats.parquet_footers import Struct, chunks, patch_footer, row_groups  # noqa: E402

EXTRA_METADATA = {"origin": "test", "note": "permuted"}  # key-value entries beside the stored Arrow schema
FILES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ints, 3 row groups": (
        {"shard_id": [1, 2, 3, 1, 2, 3], "worker_id": [0, 0, 1, 1, 1, 0], "owner_id": [0, 0, 1, 0, 1, 1],
         "gradient": [10.0, 20.0, 5.0, 0.5, -4.0, 8.0]}, {"row_group_size": 2}),
    "strings, v2 pages, plain": (
        {"shard_id": ["c", "a", "c", "b", "a"], "worker_id": ["w", "v", "v", "w", "w"],
         "owner_id": ["w", "w", "v", "w", "v"], "gradient": [1, 2, 3, 4, 5]},
        {"row_group_size": 3, "data_page_version": "2.0", "use_dictionary": ["worker_id"]}),
    "vectors, columns of other names, page index": (
        {"extra": [9, 9, 9, 9], "shard_id": [4, 4, 5, 6], "worker_id": [1, 2, 2, 2], "owner_id": [2, 2, 2, 2],
         "gradient": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], pa.list_(pa.float64(), 2)),
         "label": ["x", "y", "z", "t"]}, {"row_group_size": 2, "write_page_index": True}),
    "mean, 3 microbatches": (
        {"mb0": [1.0, None, 3.0, 4.0], "mb1": [2.0, 6.0, None, 8.0], "mb2": [None, 2.0, 3.0, 1.0]},
        {"row_group_size": 2}),
}
# Classes whose files a writer could have written: pyarrow reads them right and so must we.
HARMLESS = ("key-value metadata permuted", "a chunk's encodings permuted", "stored Arrow schema permuted")


def write(path: Path, columns: dict[str, Any], options: dict[str, Any]) -> Path:
    pq.write_table(pa.table(columns).replace_schema_metadata(EXTRA_METADATA), path, **options)
    return path


def truth(path: Path, contract: str) -> Any:
    """The reference over the rows pyarrow reads from the unchanged file, column by column name."""
    table = pq.read_table(path)
    if contract == "owner-sum":
        rows = [[r[c] for c in parquet.OWNER_COLUMNS] for r in table.to_pylist()]
        return bits(reference.owner_sum(rows))
    return bits(reference.microbatch_mean([table.column(i).to_pylist() for i in range(table.num_columns)]))


def library(path: Path, contract: str) -> Any:
    if contract == "owner-sum":
        shards, totals = owner_sum_batches(parquet.owner_batches(str(path)))
        return bits([[s, t] for s, t in zip(python_values(shards), python_values(totals))])
    return bits(python_values(microbatch_mean_batches(parquet.microbatch_batches(str(path)))))


# --- the permutations: each changes the decoded footer in place and says what it did ------------------------------


def _derangement(rng: random.Random, n: int) -> list[int]:
    """A permutation of range(n) that moves something (n >= 2)."""
    while (order := rng.sample(range(n), n)) == list(range(n)):
        pass
    return order


def _top_level(schema: list[Struct]) -> list[list[Struct]]:
    """The schema's SchemaElements below the root, one list per top-level column (a group with its children)."""
    fields, i = [], 1
    while i < len(schema):
        start, pending = i, 1
        while pending:  # SchemaElement.num_children (field 5) of each group, depth first
            pending += schema[i].get(5, (0, 0))[1] - 1
            i += 1
        fields.append(schema[start:i])
    return fields


def chunks_permuted(meta: Struct, rng: random.Random, every_group: bool) -> str:
    groups = row_groups(meta)
    order = _derangement(rng, len(chunks(groups[0])))
    picked = range(len(groups)) if every_group else [rng.randrange(len(groups))]
    for g in picked:
        items = groups[g][1][1][1]
        items[:] = [items[k] for k in order]
    return f"chunks listed as {order} in row groups {list(picked)}"


def schema_permuted(meta: Struct, rng: random.Random, with_chunks: bool) -> str:
    """The top-level columns in another order (the chunks too, in every row group, when ``with_chunks``)."""
    schema = meta[2][1][1]
    fields = _top_level(schema)
    order = _derangement(rng, len(fields))
    schema[1:] = [element for k in order for element in fields[k]]
    if with_chunks:  # (one leaf per top-level column in these files)
        for group in row_groups(meta):
            items = group[1][1][1]
            items[:] = [items[k] for k in order]
    return f"schema columns as {order}"


def row_groups_permuted(meta: Struct, rng: random.Random) -> str:
    items = meta[4][1][1]
    order = _derangement(rng, len(items))
    items[:] = [items[k] for k in order]
    return f"row groups as {order}"


def chunk_from_another_group(meta: Struct, rng: random.Random) -> str:
    groups = row_groups(meta)
    into, source = rng.sample(range(len(groups)), 2)
    column = rng.randrange(len(chunks(groups[0])))
    groups[into][1][1][1][column] = copy.deepcopy(groups[source][1][1][1][column])
    return f"row group {into} lists row group {source}'s chunk of column {column}"


def chunks_traded_between_groups(meta: Struct, rng: random.Random) -> str:
    groups = row_groups(meta)
    a, b = rng.sample(range(len(groups)), 2)
    column = rng.randrange(len(chunks(groups[0])))
    ca, cb = groups[a][1][1][1], groups[b][1][1][1]
    ca[column], cb[column] = cb[column], ca[column]
    return f"row groups {a} and {b} trade their chunks of column {column}"


def key_value_permuted(meta: Struct, rng: random.Random) -> str:
    items = meta[5][1][1]
    order = _derangement(rng, len(items))
    items[:] = [items[k] for k in order]
    return f"key-value entries as {order}"


def encodings_permuted(meta: Struct, rng: random.Random) -> str:
    lists = [chunk[3][1][2][1][1] for group in row_groups(meta) for chunk in chunks(group)]
    lists = [x for x in lists if len(x) > 1]
    items = rng.choice(lists)
    items[:] = [items[k] for k in _derangement(rng, len(items))]
    return f"a chunk's encodings as {items}"


def arrow_schema_permuted(meta: Struct, rng: random.Random, stored: Any) -> str:
    """The stored Arrow schema (``ARROW:schema``) with its fields in another order; the Parquet schema unchanged."""
    order = _derangement(rng, len(stored))
    other = pa.schema([stored.field(k) for k in order], metadata=stored.metadata)
    for entry in meta[5][1][1]:
        if entry[1][1] == b"ARROW:schema":
            entry[2] = (entry[2][0], base64.b64encode(other.serialize().to_pybytes()))
    return f"stored Arrow schema fields as {order}"


def permutations(stored: Any) -> dict[str, Callable[[Struct, random.Random], str]]:
    return {
        "chunks permuted in one row group": lambda m, r: chunks_permuted(m, r, every_group=False),
        "chunks permuted in every row group": lambda m, r: chunks_permuted(m, r, every_group=True),
        "schema permuted with the chunks": lambda m, r: schema_permuted(m, r, with_chunks=True),
        "schema permuted, chunks not": lambda m, r: schema_permuted(m, r, with_chunks=False),
        "row groups permuted": row_groups_permuted,
        "a chunk listed in two row groups": chunk_from_another_group,
        "row groups trade a column's chunks": chunks_traded_between_groups,
        "key-value metadata permuted": key_value_permuted,
        "a chunk's encodings permuted": encodings_permuted,
        "stored Arrow schema permuted": lambda m, r: arrow_schema_permuted(m, r, stored),
    }


# --- the tests -------------------------------------------------------------------------------------------------


def test_the_issue_file_is_refused_by_the_command_line(tmp_path: Path, cli: Any) -> None:
    """Issue 30's file: shard ids and gradients listed at each other's place, their own paths kept (pyarrow, by
    position, pairs `[[5, 3], [10, 1], [20, 2]]`): refused, one line, exit 2; `[[1, 10], [2, 20], [3, 5]]` unchanged."""
    columns = {"shard_id": [1, 2, 3], "worker_id": [0, 0, 0], "owner_id": [0, 0, 0], "gradient": [10, 20, 5]}
    src = write(tmp_path / "f.parquet", columns, {})
    assert cli("owner-sum", str(src))[:2] == (0, "[[1,10],[2,20],[3,5]]\n")

    def trade(meta: Struct) -> None:
        items = row_groups(meta)[0][1][1][1]
        items[0], items[3] = items[3], items[0]

    bad = patch_footer(src, tmp_path / "bad.parquet", trade)
    status, out, err = cli("owner-sum", str(bad))
    assert (status, out) == (2, "") and err.count("\n") == 1, (status, out, err)
    assert err.startswith(f"gradagg: error: {bad}: row group 0 ") and "read by position" in err, err


@pytest.mark.parametrize("name", sorted(FILES))
def test_permuted_footers_give_the_true_answer_or_are_refused(tmp_path: Path, cli: Any, name: str) -> None:
    """40 seeded permutations of one file's footer lists (the classes in :func:`permutations`, each drawn at least
    once): the library and the command line agree with the unchanged file's answer, or both refuse in one line.
    The classes a writer could produce (key-value order, encodings order, a stored Arrow schema in another order)
    are never refused; the chunk listings that pyarrow would read wrongly are refused at least once. The seed, the
    class and what was permuted are in every failure."""
    columns, options = FILES[name]
    contract = "mean" if name.startswith("mean") else "owner-sum"
    src = write(tmp_path / "src.parquet", columns, options)
    want = truth(src, contract)
    assert library(src, contract) == want
    classes = permutations(pq.read_schema(src))
    rng = random.Random(f"30-permutations-{name}")
    drawn, refusals = Counter[str](), Counter[str]()
    for case in range(40):
        kind = sorted(classes)[case] if case < len(classes) else rng.choice(sorted(classes))  # each class once first
        done: list[str] = []
        bad = patch_footer(src, tmp_path / "permuted.parquet", lambda m, k=kind, d=done: d.append(classes[k](m, rng)))
        where = (name, case, kind, done)
        drawn[kind] += 1
        try:
            got = library(bad, contract)
        except FormatError as exc:
            refusals[kind] += 1
            assert str(exc).startswith(f"{bad}: ") and "\n" not in str(exc), (*where, str(exc))
            assert kind not in HARMLESS, (*where, str(exc))
            got = None
        else:
            assert got == want, (*where, got, want)
        status, out, err = cli(contract, str(bad))
        if got is None:
            assert (status, out) == (2, "") and err.startswith(f"gradagg: error: {bad}: "), (*where, status, out, err)
            assert err.count("\n") == 1, (*where, err)
        else:
            assert (status, err) == (0, "") and bits(json.loads(out)) == want, (*where, status, out, err)
    assert set(drawn) == set(classes), drawn
    for kind in ("chunks permuted in one row group", "a chunk listed in two row groups"):
        assert refusals[kind], (kind, drawn, refusals)
