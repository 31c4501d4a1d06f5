"""HSDP: fully_shard on a 2-D mesh (2 replicas x 2 shards), 4 ranks with uneven microbatch counts.

Run:  python examples/hsdp_uneven.py
 or:  torchrun --standalone --nproc-per-node 4 examples/hsdp_uneven.py
Ranks run 2, 0, 1 and 3 microbatches; in the default (shards) form every rank runs 3 rounds, padding the
ones it has no microbatch for. FSDP reduce-scatters each round over the shard dimension and all-reduces over
the replicas in the last round only (acc.microbatches() tells every rank which it is); the divisor D (here:
the valid tokens) is counted over both mesh dimensions in finish()'s collective.
"""

import os
import sys

import torch
import torch.distributed as dist
from fsdp2_uneven import loss_sum, make_batches, make_model  # the same model and data as the FSDP2 example
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradagg.testing import launched_by_torchrun, run_world
from gradagg.torch import MicrobatchAccumulator, count_collectives

TOLERANCE = 1e-12  # float64: the same sums added in another order differ by a few 1e-17


def train_step(counts: list[int]) -> str:
    rank = dist.get_rank()
    model = make_model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acc = MicrobatchAccumulator(model)
    batches = (make_batches(3) * 2)[: sum(counts)]
    with count_collectives() as sent:
        for x, y, valid in acc.microbatches(batches[sum(counts[:rank]) : sum(counts[: rank + 1])]):
            with acc.microbatch(weight=int(valid.sum())):
                loss_sum(model, x, y, valid).backward()
        ledger = acc.finish()
    grads = [p.grad.full_tensor() for p in model.parameters()]

    truth = make_model()
    x, y, valid = (torch.cat([b[i] for b in batches]) for i in range(3))
    (loss_sum(truth, x, y, valid) / int(valid.sum())).backward()
    error = max(float((g - q.grad).abs().max()) for g, q in zip(grads, truth.parameters()))
    if error > TOLERANCE:
        raise SystemExit(f"rank {rank}: gradagg missed the full-batch gradient by {error:.1e}")
    seen = list(ledger.microbatches_per_rank or ())
    padded = acc.state.padded_last
    return f"D = {ledger.divisor:g} over counts {seen}, {padded} padded; sent {dict(sent.by_op)}; max error {error:.1e}"


if __name__ == "__main__":
    if launched_by_torchrun() and os.environ["WORLD_SIZE"] != "4":
        started = os.environ["WORLD_SIZE"]
        raise SystemExit(f"hsdp_uneven.py needs 4 ranks (a 2 x 2 mesh); the launcher started {started}")
    for r, line in enumerate(run_world(train_step, 4, [2, 0, 1, 3])):
        # One write per line: torchrun makes stdout unbuffered, and print() writes the text and its newline
        # separately, so two ranks' lines could interleave.
        sys.stdout.write(f"rank {os.environ['RANK'] if launched_by_torchrun() else r}: {line}\n")
