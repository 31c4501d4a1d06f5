"""Owner-sum engines against the reference: same inputs, same answers, bit for bit.

Every fast path on CPU adds a shard's owner gradients one at a time in row
order, starting from the first, exactly as :func:`gradagg.reference.owner_sum`
does; so float totals are compared as bit patterns (sign of zero included),
with no tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from gradagg import mutants, reference
from gradagg.errors import GradaggError, NonFiniteGradientError
from gradagg.rows.backends import _tables
from gradagg.rows.engine import ColumnarOwnerSum, owner_sum_columns
from tests.rows.engine.engine_inputs import IMPLS, NUMPY_LIKE

Columns = tuple[Any, Any, Any, Any]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each engine, chosen by its argument."""
    name = request.param
    yield name


def run(impl: str, columns: Columns, **kw: Any) -> tuple[list[Any], np.ndarray]:
    """Run one engine on NumPy columns (as tensors for torch); return shards as a list, totals as NumPy."""
    engine = impl.split("-")[0]
    if engine == "torch":
        columns = tuple(c if c.dtype.kind == "U" else torch.from_numpy(c) for c in columns)  # type: ignore[assignment]
    shards, totals = owner_sum_columns(*columns, engine=engine, **kw)
    if engine == "torch":
        assert isinstance(totals, torch.Tensor)
        totals = totals.numpy()
    return list(shards.tolist()), np.asarray(totals)


def reference_of(columns: Columns, **kw: Any) -> tuple[list[Any], list[Any]]:
    rows = [list(r) for r in zip(*(c.tolist() for c in columns))]
    pairs = reference.owner_sum(rows, **kw)
    return [p[0] for p in pairs], [p[1] for p in pairs]


def assert_same(got: tuple[list[Any], np.ndarray], want: tuple[list[Any], list[Any]], why: str) -> None:
    """Shards equal; totals equal bit for bit (floats compared as int64 bit patterns)."""
    shards, totals = got
    assert shards == want[0], why
    expected = np.asarray(want[1], dtype=totals.dtype).reshape(totals.shape)
    if totals.dtype.kind == "f":
        assert np.array_equal(totals.view(np.int64), expected.view(np.int64)), why
    else:
        assert totals.tolist() == want[1], why


def random_columns(seed: int, n: int, ids: str, grad: str) -> Columns:
    """Seeded columns: 4 workers, a fixed owner per shard plus noise, so ~1/4 to 1/3 of rows count."""
    rng = np.random.default_rng(seed)
    shard = rng.integers(0, max(1, n // 4), n)
    owner = (shard * 7 + rng.integers(0, 2, n) * (rng.random(n) < 0.05)) % 4
    worker = rng.integers(0, 4, n)
    if ids == "sparse":
        shard = rng.integers(-(2**62), 2**62, max(1, n // 4))[shard]
    elif ids == "str":
        shard = np.array([f"p{k:03d}.w" if k % 3 else f"p{k}" for k in shard.tolist()], dtype=str)
        worker, owner = worker.astype(str), owner.astype(str)
    if grad == "int":
        g: np.ndarray = rng.integers(-(10**12), 10**12, n)
    elif grad == "vec32":
        g = rng.standard_normal((n, 3)).astype(np.float32)
    else:  # float64 over many magnitudes: order matters, so only a row-ordered sum matches bit for bit
        g = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)
    return shard, worker, owner, g


@pytest.mark.parametrize("ids", ["dense", "sparse", "str"])
@pytest.mark.parametrize("grad", ["f64", "vec32", "int"])
@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_random_inputs_match_reference(impl: str, ids: str, grad: str, n: int) -> None:
    """Same seeded columns, same shards and totals as the reference (bit-identical floats)."""
    for seed in range(2):
        columns = random_columns(seed, n, ids, grad)
        assert_same(run(impl, columns), reference_of(columns), f"seed={seed} ids={ids} grad={grad} n={n}")


CASE_FIXTURES = [  # the case document's six checks, as (rows, expected pairs)
    ([["x", "a", "a", 1], ["x", "b", "a", 9], ["y", "c", "c", 2]], [["x", 1], ["y", 2]]),
    ([], []),
    ([["z", "b", "a", 1]], []),
    ([["z", "b", "a", 1], ["z", "a", "a", 3]], [["z", 3]]),
    ([["b", "b", "b", 1], ["a", "a", "a", 2]], [["a", 2], ["b", 1]]),
    ([["q", "q", "q", 1], ["q", "q", "q", 2]], [["q", 3]]),
]


@pytest.mark.parametrize("rows, expected", CASE_FIXTURES)
def test_case_document_fixtures(impl: str, rows: list[list[Any]], expected: list[list[Any]]) -> None:
    """The six boundary fixtures of the case document give the documented totals."""
    columns = tuple(np.array([r[k] for r in rows], dtype=str if k < 3 else np.int64) for k in range(4))
    shards, totals = run(impl, columns)  # type: ignore[arg-type]
    assert [[s, t] for s, t in zip(shards, totals.tolist())] == expected


def test_mutants_are_caught(impl: str) -> None:
    """On data with replicas, summing every replica or keeping the first row both differ from the engine."""
    columns = random_columns(3, 200, "dense", "int")
    rows = [list(r) for r in zip(*(c.tolist() for c in columns))]
    got = run(impl, columns)
    engine_pairs = [[s, t] for s, t in zip(got[0], got[1].tolist())]
    assert engine_pairs == reference.owner_sum(rows)
    for mutant in (mutants.sum_every_replica, mutants.first_replica):
        assert mutant(rows) != engine_pairs, mutant.__name__


def test_negative_zero_keeps_its_sign(impl: str) -> None:
    """A shard whose only owner gradient is -0.0 totals -0.0, as the reference (which starts at the first row)."""
    columns = (np.array([5, 6]), np.array([0, 0]), np.array([0, 0]), np.array([-0.0, 0.0]))
    shards, totals = run(impl, columns)
    assert shards == [5, 6]
    assert np.signbit(totals).tolist() == [True, False]


def test_all_replicas_gives_empty_result_with_shape(impl: str) -> None:
    """No owner rows: no shards; vector totals still have shape (0, D)."""
    columns = (np.array([1, 2]), np.array([0, 0]), np.array([1, 1]), np.ones((2, 4)))
    shards, totals = run(impl, columns)
    assert shards == [] and totals.shape == (0, 4)


def test_nan_propagates_and_raise_names_row_and_shard(impl: str) -> None:
    """A counted NaN reaches its total; with nonfinite='raise' the error names row 2 and shard 'b'.

    A NaN in a replica row is never counted, so it neither propagates nor raises.
    """
    columns = (np.array(["a", "b", "b"]), np.array([0, 1, 0]), np.array([0, 0, 0]), np.array([1.0, np.nan, np.inf]))
    shards, totals = run(impl, columns)
    assert shards == ["a", "b"] and totals.tolist() == [1.0, np.inf]
    with pytest.raises(NonFiniteGradientError, match=r"row 2: gradient of shard 'b' is inf"):
        run(impl, columns, nonfinite="raise")


def test_integer_totals_are_exact_and_overflow_is_refused(impl: str) -> None:
    """int64 totals are exact (2**61 + 1 is not a float); an overflowing sum raises (python engine: big ints)."""
    big = 2**61
    columns = (np.array([1, 1, 2]), np.zeros(3, np.int64), np.zeros(3, np.int64), np.array([big, 1, -big]))
    assert run(impl, columns)[1].tolist() == [big + 1, -big]
    huge = (np.array([1, 1]), np.zeros(2, np.int64), np.zeros(2, np.int64), np.array([2**62, 2**62]))
    if impl == "python":
        return  # the reference sums Python ints; 2**63 does not fit the int64 result array
    with pytest.raises(GradaggError, match="overflow int64"):
        run(impl, huge)


def feed(impl: str, columns: Columns, cuts: list[int]) -> tuple[list[Any], np.ndarray]:
    """Feed the rows to an accumulator in batches split at ``cuts``."""
    engine = impl.split("-")[0]
    acc = ColumnarOwnerSum(engine=engine)
    bounds = [0, *cuts, len(columns[0])]
    for lo, hi in zip(bounds, bounds[1:]):
        batch = tuple(c[lo:hi] for c in columns)
        if engine == "torch":
            batch = tuple(c if c.dtype.kind == "U" else torch.from_numpy(c) for c in batch)
        acc.update(*batch)
    shards, totals = acc.result()
    return list(shards.tolist()), np.asarray(totals.numpy() if engine == "torch" else totals)


@pytest.mark.parametrize("ids", ["dense", "str"])
def test_accumulator_in_batches_equals_one_shot(impl: str, ids: str) -> None:
    """Row order is kept across batches: any split gives the reference's bits."""
    columns = random_columns(5, 400, ids, "f64")
    want = reference_of(columns)
    for cuts in ([], [1], [100, 101, 350], [0, 399]):
        assert_same(feed(impl, columns, cuts), want, f"cuts={cuts}")


def test_accumulator_grows_and_leaves_the_dense_table(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids that grow the range downward, upward and then past the dense limit keep every total exact."""
    monkeypatch.setattr(_tables, "DENSE_LIMIT", 4096)
    rng = np.random.default_rng(11)
    shard = np.concatenate([rng.integers(500, 600, 50), rng.integers(-3000, 0, 50), rng.integers(0, 10**9, 50)])
    columns = (shard, np.zeros(150, np.int64), np.zeros(150, np.int64), rng.standard_normal(150) * 1e3)
    assert_same(feed(impl, columns, [50, 75, 100, 120]), reference_of(columns), "growth")


def test_torch_results_are_tensors_on_the_input_device() -> None:
    """Torch in, torch out: int64 shards and float64 totals as tensors (string shards stay NumPy)."""
    s, t = owner_sum_columns(torch.tensor([2, 1]), torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
    assert isinstance(s, torch.Tensor) and isinstance(t, torch.Tensor)
    assert t.dtype == torch.float64 and t.device == torch.device("cpu")
    s2, _ = owner_sum_columns(np.array(["a"]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1.0]))
    assert isinstance(s2, np.ndarray) and s2.tolist() == ["a"]


def test_engines_agree_on_object_and_list_ids() -> None:
    """Object arrays and lists of str/int ids are accepted and give the reference's answer."""
    got: Callable[..., Any] = owner_sum_columns
    shards, totals = got(["b", "a", "b"], [1, 2, 1], [1, 2, 3], [1.5, 2.5, 4.0])
    assert shards.tolist() == ["a", "b"] and totals.tolist() == [2.5, 1.5]
    shards, totals = got(np.array([3, 1], dtype=object), [0, 0], [0, 0], [1, 2])
    assert shards.tolist() == [1, 3] and totals.tolist() == [2, 1] and totals.dtype == np.int64


@pytest.mark.parametrize("late_ids", ["dense", "growing", "sparse"])
@pytest.mark.parametrize("chunk", [None, 64], ids=["one-pass", "two-core-split"])
def test_ids_that_grow_or_leave_the_dense_table_keep_row_order(
    monkeypatch: pytest.MonkeyPatch, late_ids: str, chunk: int | None
) -> None:
    """Later ids in one batch stay in range, grow the dense table, or leave its range altogether (the sorted
    table then takes the remaining rows): the totals stay the reference's bits.

    With 64-row chunks a 2000-row batch also takes the kernels' two-core path (a fused front pass beside a
    compacting helper thread).
    """
    if chunk is not None:
        monkeypatch.setattr(_tables, "CHUNK", chunk)
    monkeypatch.setattr(_tables, "DENSE_LIMIT", 1 << 16)
    shard, worker, owner, grad = random_columns(8, 2000, "dense", "f64")
    if late_ids == "growing":
        shard[1500:] += 40_000
    if late_ids == "sparse":
        shard[1000:] *= 10**9
    columns = (shard, worker, owner, grad)
    for engine in NUMPY_LIKE:
        assert_same(run(engine, columns), reference_of(columns), (engine, late_ids, chunk))


@pytest.mark.parametrize("jump", [0, 2047, 2048, 2049, 4097, 9999])
@pytest.mark.parametrize("chunk", [None, 1000], ids=["one-pass", "two-core-split"])
def test_ids_that_grow_at_a_block_edge_keep_row_order(
    monkeypatch: pytest.MonkeyPatch, jump: int, chunk: int | None
) -> None:
    """The fused kernel lists a block of 2048 rows' owner rows, then adds them: ids that grow the dense table
    at, just before or just after a block's edge (and in a later block) still give the reference's bits."""
    if chunk is not None:
        monkeypatch.setattr(_tables, "CHUNK", chunk)
    monkeypatch.setattr(_tables, "DENSE_LIMIT", 1 << 16)
    shard, worker, owner, grad = random_columns(10 + jump, 10_000, "dense", "f64")
    shard[jump:] += 30_000
    worker[jump] = owner[jump]  # the row where the ids jump is an owner row: the kernel stops exactly there
    shard[jump + 1 :: 3000] -= 30_000  # and some later rows fall back into the old range
    columns = (shard, worker, owner, grad)
    for engine in NUMPY_LIKE:
        assert_same(run(engine, columns), reference_of(columns), (engine, jump, chunk))


@pytest.mark.parametrize("ids", ["dense", "sparse"])
def test_vector_components_split_between_threads(monkeypatch: pytest.MonkeyPatch, ids: str) -> None:
    """Big vector batches sum half the components on a second thread (with the kernels): the reference's bits."""
    monkeypatch.setattr(_tables, "SPLIT_MIN", 0)
    columns = random_columns(9, 500, ids, "vec32")
    for engine in NUMPY_LIKE:
        assert_same(run(engine, columns), reference_of(columns), (engine, ids))


@pytest.mark.parametrize("later", [[2**63], [2**64 + 5, -(2**70)], ["s"], np.array(["s", "t"])])
def test_ids_beyond_int64_or_strings_after_int64_batches(later: Any) -> None:
    """Ids that int64 cannot hold (or strings) in a later batch are held as exact keys from then on: the
    reference's answer; ints beside strings are refused as the reference refuses them, naming both."""
    first = [0, 5, 0]
    rows = [[s, 0, 0, float(k)] for k, s in enumerate(first + list(later))]
    want = outcome_of(lambda: reference.owner_sum(rows))
    for engine in IMPLS:

        def fed(engine: str = engine) -> list[list[Any]]:
            acc = ColumnarOwnerSum(engine=engine)
            acc.update(np.array(first), np.zeros(3, int), np.zeros(3, int), np.array([0.0, 1.0, 2.0]))
            acc.update(later, [0] * len(later), [0] * len(later), [float(3 + k) for k in range(len(later))])
            return [[s, t] for s, t in zip(*(c.tolist() for c in acc.result()))]

        got = outcome_of(fed)
        assert got == want, engine


def outcome_of(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except GradaggError as exc:
        return type(exc).__name__  # (the messages name the same ids in each engine's words)
