"""FSDP2 beyond float sharding, on 2 gloo ranks: mixed precision, parameters outside FSDP, CPU offload, refusals.

The rule for each layout: the gradient of the full batch, or a GradaggError on every rank naming the parameter
and what is wrong; never a silently wrong gradient. The workers are in ``tests.torch.workers.fsdp``. Counts per rank are
uneven and include a rank with none (window form) or padding with weight-0 microbatches (every_microbatch);
weights are valid tokens (D = 13 over counts 0 and 4, D = 22 over 1 and 5).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from gradagg.testing import run_local_world
from tests.torch.workers import fsdp as fw

WORLD: dict[str, Any] = {"collective_timeout_s": 5.0, "timeout_s": 120.0, "preload": ["torch._dynamo"]}
DIVISOR = {"[0, 4]": 13, "[1, 5]": 22}  # tokens: 6 + 2 + 5 + 0; 6 | 2 + 5 + 0 + 3 + 6
# float32 (the dtype FSDP2 keeps these parameters in) against the float64 truth: float32 forward and backward,
# and sums of <= 48 per-token terms of size < 2 in another order: a few hundred float32 ulps at most (2**-24
# relative each); seen <= 6e-8.
TOL32 = 1e-5


def _error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def _n(counts: str) -> int:
    return sum(json.loads(counts))


# --- mixed precision ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_precision() -> list[dict[tuple[str, str, str], Any]]:
    return run_local_world(fw.mixed_precision_world, 2, **WORLD)


def _policy_and_layout(key: tuple[str, str, str]) -> tuple[str, str]:
    name = key[0].removesuffix(", blocks only")
    return name, ("blocks only" if name != key[0] else "root")


@pytest.fixture(scope="module")
def one_process(mixed_precision: list[dict[tuple[str, str, str], Any]]) -> dict[tuple[str, str, int], Any]:
    """The same FSDP2 model and policy in a 1-rank world, the whole batch in one backward."""
    wanted = sorted({(*_policy_and_layout(k), _n(k[2])) for k in mixed_precision[0]})
    return run_local_world(fw.reference_world, 1, wanted, **WORLD)[0]  # type: ignore[no-any-return]


def test_fsdp2_mixed_precision_matches_the_one_process_run(
    mixed_precision: list[dict[tuple[str, str, str], Any]], one_process: dict[tuple[str, str, int], Any]
) -> None:
    """MixedPrecisionPolicy with bf16 or fp16 compute (reduce_dtype float32 or None, output_dtype float32,
    cast_forward_inputs off with inputs cast by hand; one with the head left out of FSDP), in both forms: the
    sharded .grad is a float32 DTensor (the parameters' own dtype), the same on both ranks, D counted right,
    and the full-batch gradient of the same bf16 (fp16) computation in one process.

    Tolerance 2 eps S, eps the compute dtype's (bf16 2**-7, fp16 2**-10), S the largest |gradient|: the one
    process rounds each weight gradient once to the compute dtype (the whole batch in one matmul), the
    accumulator once per microbatch (<= eps / 2 relative each) and then sums them in float32; the activations
    are the same low-precision values token by token. Seen: <= 0.55 eps S against the one process, and
    <= 0.43 eps S against float64, where the one process itself is <= 0.42 eps S off.
    """
    for key, got in mixed_precision[0].items():
        assert isinstance(got, dict), (key, got)
        name, layout = _policy_and_layout(key)
        compute = fw.POLICIES[name]["param_dtype"]
        truth = fw.truth64(_n(key[2]))
        tol = 2 * torch.finfo(compute).eps * max(float(g.abs().max()) for g in truth.values())
        assert got["divisor"] == DIVISOR[key[2]] and got["second_window_same"], key
        plain = [] if layout == "root" else ["Tensor float32 cpu"]  # the head outside FSDP: a plain gradient
        assert got["grad_kinds"] == ["DTensor float32 cpu", *plain], key
        assert _error(got["grads"], one_process[(name, layout, _n(key[2]))]) <= tol, key
        assert _error(got["grads"], truth) <= tol, key
        other = mixed_precision[1][key]["grads"]
        assert all(torch.equal(got["grads"][n], other[n]) for n in other), key  # same bits on both ranks


def test_mixed_precision_tolerance_catches_the_per_rank_mean() -> None:
    """The bf16 tolerance still resolves the known wrong divisor: averaging the ranks' token means over counts
    1 and 5 (6 and 16 tokens) misses the full batch by more than 4 times it."""
    truth = fw.truth64(6)
    per_rank = {n: (fw.truth64(1)[n] + fw.truth64(6, start=1)[n]) / 2 for n in truth}
    tol = 2 * torch.finfo(torch.bfloat16).eps * max(float(g.abs().max()) for g in truth.values())
    assert _error(per_rank, truth) > 4 * tol


@pytest.fixture(scope="module")
def exact() -> list[dict[tuple[str, str, str], Any]]:
    return run_local_world(fw.exact_world, 2, **WORLD)


@pytest.mark.parametrize("mode_mesh", [f"{m} {s}" for m, s in fw.EXACT_RUNS])
@pytest.mark.parametrize("case", list(fw.EXACT_CASES))
def test_low_precision_gradients_are_summed_in_float32(
    exact: list[dict[tuple[str, str, str], Any]], case: str, mode_mesh: str
) -> None:
    """Microbatch gradients BIG, 1, 1, ... (16 ones; BIG = 256 for bf16, 2048 for fp16, so BIG + 1 rounds to BIG
    in that dtype): the mean is (BIG + 16) / 17 to the gradient dtype's rounding (one eps, relative), in both
    forms, on mesh (2,) and on HSDP (2, 1) with look-ahead. A sum in bf16 (fp16) gives BIG / 17, 6% (0.8%) off:
    what FSDP's own accumulation gave for bf16 parameters, and its deferred HSDP sum with reduce_dtype None,
    before gradagg took the shards from FSDP."""
    mode, mesh = mode_mesh.split(" ", 1)
    for rank in exact:
        r = rank[(case, mode, mesh)]
        eps = torch.finfo(r["dtype"]).eps
        assert float((r["grad"] - r["want"]).abs().max()) <= eps * r["want"], (r["grad"], r["want"])
        assert abs(r["lossy"] - r["want"]) > 4 * eps * r["want"]  # the check would catch bf16 (fp16) sums


def test_shards_fsdp_summed_itself_count_in_float32_and_are_refused_in_bf16(
    exact: list[dict[tuple[str, str, str], Any]],
) -> None:
    """Where FSDP does not call the sharded parameters' post-accumulate-grad hooks (compiled autograd; here the
    hooks are removed), it sums the microbatches into .grad itself: float32 parameters still get the exact mean;
    bf16 parameters (a bf16 sum) make finish() raise WindowError on both ranks, naming the parameter."""
    for rank in exact:
        r = rank[("bf16 compute, reduce fp32", "hooks not run", "(2,)")]
        assert float((r["grad"] - r["want"]).abs().max()) <= torch.finfo(r["dtype"]).eps * r["want"]
        kind, message = rank[("bf16 parameters", "hooks not run", "(2,)")]
        assert kind == "WindowError" and "'weight'" in message and "bfloat16" in message, message


# --- parameters outside FSDP, CPU offload ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def outside() -> list[dict[tuple[str, str, str], Any]]:
    return run_local_world(fw.outside_fsdp_world, 2, **WORLD)


@pytest.mark.parametrize("layout", [*fw.MIXED_LAYOUTS, "blocks only, HSDP", "cpu offload"])
def test_parameters_outside_fsdp_and_cpu_offload(outside: list[dict[tuple[str, str, str], Any]], layout: str) -> None:
    """The head outside every FSDP unit (fully_shard on the blocks only; the root with the head in ignored_params;
    the head attached after fully_shard(root)), on mesh (2,) and HSDP (2, 1): its plain float32 gradient is summed
    over all ranks as a replica's and divided by the same D as the DTensor shards. CPUOffloadPolicy: DTensor
    gradients on the CPU. Both forms, against the float64 full batch."""
    runs = {k: v for k, v in outside[0].items() if k[0] == layout}
    assert runs
    for key, got in runs.items():
        assert isinstance(got, dict), (key, got)
        assert got["divisor"] == DIVISOR[key[2]] and got["second_window_same"], key
        plain = [] if layout == "cpu offload" else ["Tensor float32 cpu"]
        assert got["grad_kinds"] == ["DTensor float32 cpu", *plain], key
        for rank in outside:
            assert _error(rank[key]["grads"], fw.truth64(_n(key[2]))) <= TOL32, key


@pytest.mark.parametrize("mode", ["shards", "window", "every_microbatch"])
def test_dtensor_outside_fully_shard_refused_on_every_rank(
    outside: list[dict[tuple[str, str, str], Any]], mode: str
) -> None:
    """A Shard(0) DTensor registered on the root after fully_shard is gathered and reduced by no FSDP unit: both
    ranks (rank 0 running no microbatch) raise GradaggError at the window's start naming it and its placement."""
    for rank in outside:
        kind, message = rank[("unmanaged DTensor", mode, "[0, 2]")]
        assert kind == "GradaggError", message
        assert "'gain'" in message and "(Shard(dim=0),)" in message and "fully_shard" in message, message


@pytest.mark.parametrize("mode", ["shards", "window", "every_microbatch"])
def test_plain_parameter_replaced_after_construction_refused_on_every_rank(
    outside: list[dict[tuple[str, str, str], Any]], mode: str
) -> None:
    """Rank 1 replaces the plain head's weight by a new Parameter of the same name after the accumulator was built:
    its gradient would be neither reduced nor divided; both ranks refuse, naming rank 1 and, there, the parameter."""
    for rank in outside:
        kind, message = rank[("plain replaced", mode, "[1, 1]")]
        assert kind == "WindowError" and "rank 1 accumulates other parameters" in message, message
    assert "'head.weight'" in outside[1][("plain replaced", mode, "[1, 1]")][1]


# --- refused layouts -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refused() -> list[dict[str, Any]]:
    return run_local_world(fw.refused_world, 2, **WORLD)


@pytest.mark.parametrize(
    ("layout", "placement"),
    [
        ("tensor parallel", "(Shard(dim=0),)"),
        ("FSDP + TP, 2-D mesh", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
        ("HSDP + TP, 3-D mesh", "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"),
        ("Shard(1)", "(Shard(dim=1),)"),
    ],
)
def test_other_layouts_refused_at_construction(refused: list[dict[str, Any]], layout: str, placement: str) -> None:
    """Tensor parallel without FSDP, FSDP or HSDP on top of tensor parallel (2-D and 3-D meshes), and FSDP sharding
    on dim 1: GradaggError when the accumulator is built, on both ranks, naming blocks.0.weight and its placement."""
    for rank in refused:
        kind, message = rank[layout]
        assert kind == "GradaggError", message
        assert "'blocks.0.weight'" in message and placement in message, message


# --- memory: what the every_microbatch form holds ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["shards", "window", "every_microbatch"])
def test_only_the_window_form_holds_the_whole_model_unsharded(mode: str) -> None:
    """shards (the default; every_microbatch its former name) is the memory-saving form: opening a window unshards one
    FSDP module at a time (to hook its unsharded parameters) and reshards it before the next, so the forward starts
    from shards; the window form keeps every module unsharded over the window by design."""
    for rank in run_local_world(fw.unshard_peak_world, 2, mode, **WORLD):
        if mode != "window":
            assert rank["peak"] == 1 and rank["sharded at forward"], rank
        else:
            assert rank["peak"] == rank["modules"] and not rank["sharded at forward"], rank
