"""Parquet files corrupt in the ways a hostile or broken writer makes them: refused by name, never summed wrong.

The footers are rewritten with :mod:`tests.rows.formats.parquet_footers` (what
pyarrow would never write: column chunks in another order, a chunk missing,
row counts that lie); the bytes are mutated one at a time at seeded positions.
Every outcome is either the reference's answer over what pyarrow itself decodes
from the file with the footer's counts, or one line of
:class:`~gradagg.errors.GradaggError` that names the file; never another exception.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gradagg import reference  # noqa: E402  (after the importorskips)
from gradagg.errors import FormatError, GradaggError  # noqa: E402
from gradagg.rows.engine import microbatch_mean_batches, owner_sum_batches, python_values  # noqa: E402
from gradagg.rows.formats import parquet  # noqa: E402
from tests.rows.engine.engine_inputs import bits  # noqa: E402
from tests.rows.formats.parquet_footers import Struct, patch_footer, row_groups  # noqa: E402

OWNER = {"shard_id": [3, 1, 3, 2], "worker_id": [0, 1, 1, 2], "owner_id": [0, 0, 1, 2],
         "gradient": [0.5, 9.0, 2.0, 4.0]}
OWNER_STR = {**OWNER, "shard_id": ["c", "a", "c", "b"]}
MEAN = {"mb0": [1.0, None, 3.0, 4.0], "mb1": [2.0, 5.0, None, 8.0]}


def write(tmp_path: Path, name: str, columns: dict[str, list[Any]], **options: Any) -> Path:
    path = tmp_path / name
    pq.write_table(pa.table(columns), path, **options)
    return path


def owner_sum(path: Path) -> list[list[Any]]:
    shards, totals = owner_sum_batches(parquet.owner_batches(str(path)))
    return [[s, t] for s, t in zip(python_values(shards), python_values(totals))]


def mean(path: Path) -> list[Any]:
    return python_values(microbatch_mean_batches(parquet.microbatch_batches(str(path))))


def refused(fn: Any, path: Path, match: str) -> None:
    """A FormatError of one line that names the file and says ``match``."""
    with pytest.raises(FormatError, match=match) as info:
        fn(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message


# --- column chunks listed in another order than the schema --------------------------------------------------


@pytest.mark.parametrize("swap", [(0, 1), (0, 3), (1, 2), (2, 3)])
@pytest.mark.parametrize("columns", ["int", "str"])
def test_column_chunks_in_another_order_are_refused(tmp_path: Path, swap: tuple[int, int], columns: str) -> None:
    """Each chunk's own path is right but two are listed at each other's place: pyarrow would read them by
    position (shard ids as gradients, workers as shards); the reader refuses, naming both columns."""
    table = OWNER if columns == "int" else OWNER_STR
    src = write(tmp_path, "rows.parquet", table, row_group_size=2)
    assert owner_sum(src) == reference.owner_sum([list(r) for r in zip(*table.values())])

    def reorder(meta: Struct) -> None:
        for group in row_groups(meta)[-1:]:  # only the last row group: the first one reads fine
            items = group[1][1][1]
            items[swap[0]], items[swap[1]] = items[swap[1]], items[swap[0]]

    bad = patch_footer(src, tmp_path / "reordered.parquet", reorder)
    # Chunks of one physical type decode as each other's: our check names them. Of two types, pyarrow's
    # decoder refuses them first (its words, the file named).
    same_type = {swap} <= {(0, 1), (0, 2), (1, 2)} and columns == "int"
    words = "row group 1 lists the chunk of column '.*' where the schema has column" if same_type else (
        "row group 1 lists the chunk|type does not match|does not support")
    refused(owner_sum, bad, words)


def test_mean_column_chunks_in_another_order_are_refused(tmp_path: Path) -> None:
    """The same for a mean file (swapped microbatch columns would give the right means only by luck)."""
    src = write(tmp_path, "mean.parquet", MEAN)

    def reverse(meta: Struct) -> None:
        row_groups(meta)[0][1][1][1].reverse()

    bad = patch_footer(src, tmp_path / "reordered.parquet", reverse)
    refused(mean, bad, "row group 0 lists the chunk of column 'mb1' where the schema has column 'mb0'")


def relabel(meta: Struct, order: list[int], groups: slice = slice(None)) -> None:
    """List each row group's chunks as ``order`` says (a chunk may appear twice), then give every listed chunk the
    path of the schema column at its place: the paths agree with the schema, only the data is elsewhere."""
    for group in row_groups(meta)[groups]:
        items = group[1][1][1]
        paths = [chunk[3][1][3] for chunk in items]  # ColumnChunk.meta_data.path_in_schema, in schema order
        items[:] = [copy.deepcopy(items[k]) for k in order]
        for chunk, path in zip(items, paths):
            chunk[3][1][3] = path


@pytest.mark.parametrize("swap", [(0, 3), (0, 1), (1, 2)])
@pytest.mark.parametrize("columns", ["int", "str"])
def test_column_chunks_in_another_order_with_their_paths_rewritten_are_refused(
    tmp_path: Path, swap: tuple[int, int], columns: str
) -> None:
    """Issue 22: chunks listed in another order, each listed chunk's path the schema's at its place: pyarrow read
    shard ids as gradients and printed a wrong answer, exit 0. The chunks' data lies out of the schema's order:
    refused, naming both columns."""
    table = {**(OWNER if columns == "int" else OWNER_STR), "gradient": [5, 9, 2, 4]}
    src = write(tmp_path, "rows.parquet", table, row_group_size=2)
    order = list(range(4))
    order[swap[0]], order[swap[1]] = order[swap[1]], order[swap[0]]
    bad = patch_footer(src, tmp_path / "reordered.parquet", lambda meta: relabel(meta, order, slice(-1, None)))
    ours = "row group 1: the data of column .* lies before the data of column"
    # Chunks of two physical types (a string shard id): pyarrow's decoder refuses them first, in its words.
    refused(owner_sum, bad, ours if columns == "int" or 0 not in swap else f"{ours}|does not support")


def test_mean_column_chunks_in_another_order_with_their_paths_rewritten_are_refused(tmp_path: Path) -> None:
    src = write(tmp_path, "mean.parquet", MEAN)
    bad = patch_footer(src, tmp_path / "reordered.parquet", lambda meta: relabel(meta, [1, 0]))
    refused(mean, bad, "row group 0: the data of column 'mb1' lies before the data of column 'mb0'")


RELABELLED_FILES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ints": ({**OWNER, "gradient": [5, 9, 2, 4]}, {"row_group_size": 2}),
    "ints, plain": ({**OWNER, "gradient": [5, 9, 2, 4]}, {"use_dictionary": False, "compression": "none"}),
    "strings, v2 pages": (OWNER_STR, {"data_page_version": "2.0", "row_group_size": 3}),
    "vectors": ({**OWNER, "gradient": pa.array([[1, 2], [3, 4], [5, 6], [7, 8]], pa.list_(pa.int64(), 2))}, {}),
    "mean": ({**MEAN, "mb2": [1.0, 2.0, None, 4.0]}, {"row_group_size": 3}),
}


@pytest.mark.parametrize("name", sorted(RELABELLED_FILES))
def test_chunks_listed_anywhere_with_the_schemas_paths_are_refused_or_right(tmp_path: Path, name: str) -> None:
    """The class: 60 seeded listings of each file's chunks (permuted, or one chunk listed twice, in one row group
    or all), each listed chunk given the schema's path at its place. Each is refused by a one-line FormatError
    naming the file, or gives the true file's answer (two columns of equal data may trade places). The seed,
    the listing and the row groups are in every failure."""
    columns, options = RELABELLED_FILES[name]
    fn = mean if name == "mean" else owner_sum
    src = write(tmp_path, "src.parquet", columns, **options)
    truth = bits(fn(src))
    n = len(columns)
    rng = random.Random(f"22-chunks-{name}")
    refusals = 0
    for _ in range(60):
        order = rng.sample(range(n), n)
        if rng.random() < 0.3:
            order[rng.randrange(n)] = rng.randrange(n)  # one chunk listed twice, another not at all
        groups = rng.choice([slice(None), slice(0, 1), slice(-1, None)])
        bad = patch_footer(src, tmp_path / "relabelled.parquet", lambda m, o=order, g=groups: relabel(m, o, g))
        try:
            got = bits(fn(bad))
        except FormatError as exc:
            refusals += 1
            assert str(exc).startswith(f"{bad}: ") and "\n" not in str(exc), (name, order, groups, str(exc))
            continue
        assert got == truth, (name, order, groups, got, truth)
    assert refusals, "no listing was refused: the listings missed the chunks"


# --- a chunk listed in two row groups, its path right -----------------------------------------------------------


CROSS_LISTINGS = {  # (row group that lists it, column, row group whose chunk it is): what the refusal says
    (0, 3, 1): "row group 1: the data of column 'shard_id' lies before the data of column 'gradient' of row group 0",
    (1, 0, 0): "row group 1: the data of column 'shard_id' lies before the data of column 'gradient' of row group 0",
    (1, 3, 0): "row group 1: the data of column 'gradient' lies before the data of column 'owner_id' ",
}


@pytest.mark.parametrize("listing", sorted(CROSS_LISTINGS))
def test_a_chunk_listed_in_two_row_groups_is_refused(tmp_path: Path, cli: Any, listing: tuple[int, int, int]) -> None:
    """Issue 30: a row group lists another row group's chunk of the same column, every chunk's path right: pyarrow
    read that chunk for both groups (the first group's shard ids paired with the second group's gradients:
    ``[[1, 5], [2, 7], [3, 5], [4, 7]]``, exit 0). Each row group's chunks must lie after the previous group's:
    refused by the library and by the command line (one line, exit 2, nothing on standard output)."""
    into, column, source = listing
    columns = {"shard_id": [1, 2, 3, 4], "worker_id": [0] * 4, "owner_id": [0] * 4, "gradient": [10, 20, 5, 7]}
    src = write(tmp_path, "rows.parquet", columns, row_group_size=2)
    assert owner_sum(src) == [[1, 10], [2, 20], [3, 5], [4, 7]]

    def relist(meta: Struct) -> None:
        groups = row_groups(meta)
        groups[into][1][1][1][column] = copy.deepcopy(groups[source][1][1][1][column])

    bad = patch_footer(src, tmp_path / "relisted.parquet", relist)
    refused(owner_sum, bad, CROSS_LISTINGS[listing])
    status, out, err = cli("owner-sum", str(bad))
    assert (status, out) == (2, ""), (status, out, err)
    assert err.startswith(f"gradagg: error: {bad}: {CROSS_LISTINGS[listing]}") and err.count("\n") == 1, err


def test_chunks_of_two_row_groups_shared_out_with_the_schemas_paths_are_refused(tmp_path: Path) -> None:
    """Issue 22's class across row groups: the file's 8 chunks shared out between its 2 row groups, each group's in
    the order of their data, each given the schema's path at its place (the second group lists the first's workers):
    pyarrow read owner ids as workers and printed `[]`, exit 0. Refused: data before the previous group's."""
    columns = {"shard_id": [1, 2, 3, 4], "worker_id": [0] * 4, "owner_id": [0] * 4, "gradient": [10, 20, 5, 7]}
    src = write(tmp_path, "rows.parquet", columns, row_group_size=2)

    def share_out(meta: Struct) -> None:
        first, second = (group[1][1][1] for group in row_groups(meta))
        pool = first + second
        paths = [chunk[3][1][3] for chunk in first]
        first[:], second[:] = ([copy.deepcopy(pool[k]) for k in ks] for ks in ((0, 2, 4, 6), (1, 3, 5, 7)))
        for chunk, path in [*zip(first, paths), *zip(second, paths)]:
            chunk[3][1][3] = path

    bad = patch_footer(src, tmp_path / "shared.parquet", share_out)
    refused(owner_sum, bad, "row group 1: the data of column 'shard_id' lies before the data of column 'gradient' of "
                            "row group 0")


def test_a_mean_chunk_listed_in_two_row_groups_is_refused(tmp_path: Path) -> None:
    src = write(tmp_path, "mean.parquet", MEAN, row_group_size=2)
    bad = patch_footer(src, tmp_path / "relisted.parquet",
                       lambda m: row_groups(m)[0][1][1][1].__setitem__(1, copy.deepcopy(row_groups(m)[1][1][1][1][1])))
    refused(mean, bad, "row group 1: the data of column 'mb0' lies before the data of column 'mb1' of row group 0")


# --- a row group with fewer (or more) column chunks than the schema -----------------------------------------


@pytest.mark.parametrize("drop", [0, 3])
def test_a_row_group_missing_a_column_chunk_is_refused(tmp_path: Path, drop: int) -> None:
    """A row group lists 3 column chunks for a 4-column schema: refused by name (was an IndexError)."""
    for fn, name, columns in ((owner_sum, "rows.parquet", OWNER), (mean, "mean.parquet", {**MEAN, "mb2": MEAN["mb0"]})):
        src = write(tmp_path, name, columns)
        k = min(drop, len(columns) - 1)
        bad = patch_footer(src, tmp_path / f"short-{name}", lambda m, k=k: row_groups(m)[0][1][1][1].pop(k))
        refused(fn, bad, f"row group 0 has {len(columns) - 1} column chunks but the schema has {len(columns)} columns")


def test_a_row_group_with_an_extra_column_chunk_is_refused(tmp_path: Path) -> None:
    src = write(tmp_path, "rows.parquet", OWNER)
    bad = patch_footer(src, tmp_path / "long.parquet",
                       lambda m: row_groups(m)[0][1][1][1].append(row_groups(m)[0][1][1][1][0]))
    refused(owner_sum, bad, "row group 0 has 5 column chunks but the schema has 4 columns")


# --- row counts that lie --------------------------------------------------------------------------------------


@pytest.mark.parametrize("columns", [OWNER, OWNER_STR])
@pytest.mark.parametrize("declared", [3, 5])
def test_a_row_group_that_declares_other_rows_than_its_chunks_hold_is_refused(
    tmp_path: Path, columns: dict[str, list[Any]], declared: int
) -> None:
    """The row group says 3 (or 5) rows, its chunks hold 4 values each: pyarrow would read 3 and drop a shard's
    row silently; the reader refuses, naming both counts (string ids included)."""
    src = write(tmp_path, "rows.parquet", columns)

    def lie(meta: Struct) -> None:
        group = row_groups(meta)[0]
        group[3] = (group[3][0], declared)  # RowGroup.num_rows
        meta[3] = (meta[3][0], declared)  # FileMetaData.num_rows

    bad = patch_footer(src, tmp_path / "lying.parquet", lie)
    refused(owner_sum, bad, f"row group 0 declares {declared} rows but its column 'shard_id' holds 4 values")


def test_a_footer_whose_row_groups_do_not_add_up_is_refused(tmp_path: Path) -> None:
    src = write(tmp_path, "mean.parquet", MEAN)
    bad = patch_footer(src, tmp_path / "lying.parquet", lambda m: m.__setitem__(3, (m[3][0], 7)))
    refused(mean, bad, "the row groups hold 4 rows but the footer declares 7")


def test_check_footer_accepts_what_pyarrow_writes(tmp_path: Path) -> None:
    """Vectors (a repeated leaf: rows x D values), strings, several row groups: no false alarm, the reference's
    answer."""
    vectors = [[1.0, 2.0], [3.0, -0.0], [5.0, 6.0], [7.0, 8.0]]
    columns = {**OWNER_STR, "gradient": pa.array(vectors, pa.list_(pa.float64(), 2))}
    path = write(tmp_path, "vectors.parquet", columns, row_group_size=3)
    parquet.check_footer(pq.ParquetFile(path).metadata, str(path))
    rows = [[s, w, o, g] for s, w, o, g in zip(OWNER_STR["shard_id"], OWNER["worker_id"], OWNER["owner_id"], vectors)]
    assert bits(owner_sum(path)) == bits(reference.owner_sum(rows))


# --- single-byte mutations of real files ------------------------------------------------------------------------


MUTATED_FILES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ints, snappy, dictionary pages": (OWNER, {"row_group_size": 3}),
    "ints, plain, uncompressed, page checksums": (OWNER, {"use_dictionary": False, "compression": "none",
                                                          "write_page_checksum": True}),
    "string ids, v2 pages": (OWNER_STR, {"data_page_version": "2.0", "row_group_size": 2}),
    "mean, nullable": (MEAN, {"write_page_checksum": True}),
}


@pytest.mark.parametrize("name", sorted(MUTATED_FILES))
def test_single_byte_mutations_are_refused_or_read_as_pyarrow_reads_them(tmp_path: Path, name: str) -> None:
    """300 seeded single-byte mutations of a real small file (a byte zeroed, set to 0xFF, or one bit flipped;
    headers, pages and footer alike): each either gives the reference's answer over what pyarrow itself
    decodes from that file, or is a one-line GradaggError; never a total pyarrow would not give, never
    another exception. Any failure prints the seed, position and byte to replay it."""
    columns, options = MUTATED_FILES[name]
    contract = "mean" if name.startswith("mean") else "owner-sum"
    fn = mean if contract == "mean" else owner_sum
    src = write(tmp_path, "src.parquet", columns, **options)
    data = src.read_bytes()
    rng = random.Random(f"16-{name}")
    path = tmp_path / "mutated.parquet"
    refusals = 0
    for _ in range(300):
        pos = rng.randrange(len(data))
        byte = rng.choice([0, 0xFF, data[pos] ^ (1 << rng.randrange(8))])
        path.write_bytes(data[:pos] + bytes([byte]) + data[pos + 1 :])
        want = what_pyarrow_decodes(path, contract)
        try:
            got = ("answer", bits(fn(path)))
        except GradaggError as exc:
            refusals += 1
            assert "\n" not in str(exc) and str(exc), (name, pos, byte, str(exc))
            assert not isinstance(exc, FormatError) or str(exc).startswith(f"{path}: "), (name, pos, byte, str(exc))
            continue
        assert got == want, (name, pos, byte, got, want)
    assert refusals, "no mutation was refused: the mutations missed the file's structure"


def what_pyarrow_decodes(path: Path, contract: str) -> Any:
    """The reference over the rows pyarrow itself decodes with the footer's counts, or why there is none."""
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001  (pyarrow raises many kinds: any of them is a refusal here)
        return ("pyarrow refused", type(exc).__name__)
    try:
        if contract == "owner-sum":
            rows = [[r[c] for c in parquet.OWNER_COLUMNS] for r in table.to_pylist()]
            return ("answer", bits(reference.owner_sum(rows)))
        microbatches = [table.column(i).to_pylist() for i in range(table.num_columns)]
        return ("answer", bits(reference.microbatch_mean(microbatches)))
    except (GradaggError, KeyError, TypeError, UnicodeDecodeError) as exc:  # a column gone or retyped by the flip
        return ("reference refused", type(exc).__name__)
