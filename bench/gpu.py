"""Check the CUDA path against the reference, then time owner-sum on 10^8 rows against device copy bandwidth.

    .venv/bin/python bench/gpu.py            # checks, then timings (well under 5 minutes on one GPU)
    .venv/bin/python bench/gpu.py --rows 1e7 # a smaller timing run

On a machine without a CUDA device it prints why it skips and exits 0.

Checks (seeded, small): shards equal the reference's exactly; integer totals
and microbatch means equal bit for bit (elementwise float64 adds are
deterministic); float owner-sum totals are within the documented bound for
an unordered sum, ``2 * (n - 1) * 2**-53 * sum(|g|)`` per shard (CUDA's
``index_add_`` adds with atomics in no fixed order).

Timing: median wall time (after ``torch.cuda.synchronize``) of
``owner_sum_columns`` on device tensors, against the time of one device-to-device
copy of the same bytes (which reads them once and writes them once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

U = 2.0**-53


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=float, default=1e8, help="rows for the timing run (default 1e8)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not installed, so there is no CUDA path to check")
        return 0
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device here (torch.cuda.is_available() is False); run this on a GPU machine")
        return 0
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    failures = check_against_reference(torch, device)
    if failures:
        print("\n".join(failures))
        return 1
    print("checks: CUDA owner-sum and microbatch mean agree with the reference")
    time_owner_sum(torch, device, int(args.rows), args.repeat)
    return 0


def check_against_reference(torch: Any, device: Any) -> list[str]:
    """Seeded inputs through the CUDA path; a list of failure messages (empty when all agree)."""
    from gradagg import reference
    from gradagg.rows import microbatch_mean_columns, owner_sum_columns, python_values

    failures = []
    for seed in range(3):
        for kind in ("int-ids", "sparse-ids", "str-ids", "vector", "int-grad"):
            shard, worker, owner, grad = _columns(seed, kind)
            rows = [list(r) for r in zip(shard.tolist(), worker.tolist(), owner.tolist(), grad.tolist())]
            want = reference.owner_sum(rows)
            on_device = [c if c.dtype.kind == "U" else torch.from_numpy(c).to(device) for c in (shard, worker, owner)]
            shards, totals = owner_sum_columns(*on_device, torch.from_numpy(grad).to(device))
            if totals.device.type != "cuda":
                failures.append(f"seed {seed} {kind}: totals came back on {totals.device}, not on the GPU")
            problem = _compare(rows, want, python_values(shards), totals.cpu().numpy())
            if problem:
                failures.append(f"seed {seed} {kind}: {problem}")
        values = np.random.default_rng(seed).standard_normal((6, 1000)).astype(np.float32)
        present = np.random.default_rng(seed + 1).random((6, 1000)) >= 0.1
        got = microbatch_mean_columns(torch.from_numpy(values).to(device), torch.from_numpy(present).to(device))
        rows_m = [[v if p else None for v, p in zip(vr, pr)] for vr, pr in zip(values.tolist(), present.tolist())]
        if got.cpu().numpy().tolist() != reference.microbatch_mean(rows_m):
            failures.append(f"seed {seed} microbatch mean: differs from the reference")
    return failures


def _columns(seed: int, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = 5000
    shard = rng.integers(0, 300, n)
    owner, worker = shard % 3, rng.integers(0, 3, n)
    scale = 10.0 ** rng.integers(-6, 6, n)  # many magnitudes, so summation order shows
    grad = rng.standard_normal((n, 4)) * scale[:, None] if kind == "vector" else rng.standard_normal(n) * scale
    if kind == "sparse-ids":
        shard = rng.integers(0, 2**62, 300)[shard]
    if kind == "str-ids":
        shard = np.array([f"s{k}" for k in shard.tolist()])
    if kind == "int-grad":
        grad = rng.integers(-(10**9), 10**9, n)
    return shard, worker, owner, grad


def _compare(rows: list[list[Any]], want: list[list[Any]], shards: list[Any], totals: np.ndarray) -> str:
    """'' when shards match exactly and each total is within the unordered-sum bound (exact for ints)."""
    if shards != [p[0] for p in want]:
        return "shards differ from the reference"
    magnitude: dict[Any, Any] = {}
    count: dict[Any, int] = {}
    for s, w, o, g in rows:
        if w == o:
            magnitude[s] = magnitude.get(s, 0) + np.abs(np.asarray(g, dtype=np.float64))
            count[s] = count.get(s, 0) + 1
    for (s, expected), got in zip(want, totals):
        exp = np.asarray(expected, dtype=np.float64)
        if totals.dtype.kind == "i":
            if np.asarray(got).tolist() != expected:
                return f"shard {s!r}: integer total {got} != {expected}"
            continue
        bound = 2 * (count[s] - 1) * U * magnitude[s]
        if np.any(np.abs(got - exp) > bound):
            return f"shard {s!r}: total {got} differs from {expected} by more than {bound}"
    return ""


def time_owner_sum(torch: Any, device: Any, n: int, repeat: int) -> None:
    """Median time of owner-sum on n device rows, against a device copy of the same bytes."""
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"{'case':<40} {'median ms':>10} {'GB/s read':>10} {'x copy':>8}")
    for shards in (10**3, 10**6):
        _time_case(torch, device, gen, n, shards, repeat)
        torch.cuda.empty_cache()


def _time_case(torch: Any, device: Any, gen: Any, n: int, shards: int, repeat: int) -> None:
    from gradagg.rows import owner_sum_columns

    shard = torch.randint(0, shards, (n,), generator=gen, device=device)
    owner = shard * 7919 % 3  # each shard's owner is fixed; with 3 workers, ~1/3 of rows count
    worker = torch.randint(0, 3, (n,), generator=gen, device=device)
    grad = torch.randn(n, generator=gen, device=device, dtype=torch.float64)
    nbytes = sum(t.numel() * t.element_size() for t in (shard, owner, worker, grad))
    flat = torch.empty(nbytes // 8, dtype=torch.int64, device=device)
    copy = _median(torch, flat.clone, repeat)
    run = _median(torch, lambda: owner_sum_columns(shard, worker, owner, grad), repeat)
    print(f"{'device copy of the same bytes':<40} {copy * 1e3:>10.1f} {nbytes / copy / 1e9:>10.0f} {1.0:>8.2f}")
    label = f"owner-sum N={n:.0e} S={shards:.0e}"
    print(f"{label:<40} {run * 1e3:>10.1f} {nbytes / run / 1e9:>10.0f} {run / copy:>8.2f}")


def _median(torch: Any, fn: Callable[[], object], repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
