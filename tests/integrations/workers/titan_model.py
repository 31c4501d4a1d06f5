"""torchtitan 0.3.0's own Llama 3, built from a tiny config and parallelized by its own ``parallelize_llama``, on CPU.

The model is the issue's tiny Llama (vocab 128, dim 32, 2 layers, 4 heads, 2 KV heads, FFN 64) as torchtitan builds
it: meta-device construction, ``parallelize_llama`` (activation checkpointing, then ``fully_shard`` per block and at
the root, FSDP's own gradient division switched off), ``to_empty`` and ``init_weights``. torchtitan targets GPUs;
three shims, each the smallest found, let its code run on CPU gloo ranks (see :func:`cpu_shims` and :func:`build`):

* ``triton``: ``torchtitan.models.common`` imports MinimalAsyncEP's triton kernels (MoE expert parallelism over
  symmetric memory) at import time, and CPU torch has no triton. A stand-in module whose functions raise takes their
  place; a dense Llama never calls them.
* the device type: torchtitan picks ``"cuda"`` when no accelerator is found; its mesh is built with ``"cpu"``.
* attention: the Llama configs' FlexAttention is compiled by inductor (slow, a C++ toolchain on CPU);
  torchtitan's own ``ScaledDotProductAttention`` (causal) is used instead. Sequences are right-padded, so causal
  attention never lets a real token see padding.
* gloo has no ``PREMUL_SUM``: torchtitan sets FSDP's divide factor to 1, which FSDP sends as a premultiplied
  sum by 1/1; ``set_force_sum_reduction_for_comms`` sends the same sum as a plain SUM.

Batches are torchtitan's: ``({"input": tokens[:, :-1]}, labels[:, 1:])``, labels -100 on prompts and padding.
"""

from __future__ import annotations

import copy
import sys
import types
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.integrations import tiny_llama

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]
Grads = dict[str, torch.Tensor]
WRAPPED = "_checkpoint_wrapped_module."  # the prefix CheckpointWrapper adds to the names of the block's parameters
BACKENDS = ("partial_dtensor", "full_dtensor")  # spmd_types, 0.3.0's default, needs a fully_shard newer than 2.13's
_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _absent_kernel(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: a triton kernel of torchtitan's MinimalAsyncEP, CUDA only")

    return refuse


def cpu_shims() -> None:
    """The triton stand-in and the CPU device type (module docstring); idempotent, before torchtitan's models load."""
    if _KERNELS not in sys.modules:
        stand_in = types.ModuleType(_KERNELS)

        def __getattr__(name: str) -> Any:  # dunders must stay absent: inspect walks sys.modules reading __file__
            if name.startswith("__"):
                raise AttributeError(name)
            return _absent_kernel(name)

        stand_in.__getattr__ = __getattr__  # type: ignore[method-assign]
        sys.modules[_KERNELS] = stand_in
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"  # read when ParallelDims builds its world mesh


def tiny_config() -> Any:
    """The issue's tiny Llama as a ``Llama3Model.Config`` (torchtitan's debugmodel layout, smaller, SDPA attention)."""
    cpu_shims()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    dim, heads, kv_heads, hidden, vocab = 32, 4, 2, 64, tiny_llama.VOCAB
    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000)
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
            attention=make_gqa_config(dim=dim, n_heads=heads, n_kv_heads=kv_heads, wqkv_param_init=linear,
                                      wo_param_init=linear, inner_attention=ScaledDotProductAttention.Config(),
                                      fuse_qkv=True, rope=rope),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=linear, w2w3_param_init=linear),
        )
        for _ in range(2)
    ]
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab, layers=layers, norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear),
    )


def parallelism(backend: str) -> Any:
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(spmd_backend=backend)  # type: ignore[arg-type]


_DIMS: dict[str, Any] = {}


def parallel_dims(backend: str) -> Any:
    """torchtitan's ParallelDims for this world, data parallel only (FSDP over every rank); one per backend and
    process, as in torchtitan (a second one's meshes are new objects, which fully_shard then refuses to mix)."""
    if backend in _DIMS:
        return _DIMS[backend]
    cpu_shims()
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(backend)
    _DIMS[backend] = ParallelDims.from_config(parallelism(backend), dist.get_world_size())
    return _DIMS[backend]


def build(backend: str, ac: bool, dims: Any, seed: int = 0) -> nn.Module:
    """torchtitan's Llama as its Trainer builds it: meta, ``parallelize_llama``, ``to_empty``, ``init_weights``.

    Args:
        backend: ``"partial_dtensor"`` (FSDP2's DTensor shards) or ``"full_dtensor"`` (every parameter a DTensor
            on the dense mesh, inputs too).
        ac: selective activation checkpointing (torchtitan's default policy) on every block, or none.
        dims: :func:`parallel_dims` of the same backend.
        seed: the initial weights, the same on every rank.
    """
    import types as _types

    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.llama3.parallelize import parallelize_llama

    config, par = tiny_config(), parallelism(backend)
    config.update_from_config(config=_types.SimpleNamespace(parallelism=par))  # the sharding specs, as Trainer does
    with torch.device("meta"):
        model = config.build()
    # float32 compute: torchtitan's default bf16 compute would put bf16 round-off (~1e-2) on both sides of every check.
    training = TrainingConfig(mixed_precision_param="float32")
    model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=par,
                              compile_config=CompileConfig(), ac_config=SelectiveAC.Config() if ac else None,
                              dump_folder="")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (module docstring)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model  # type: ignore[no-any-return]


def plain_name(name: str) -> str:
    """A parameter's name in the unwrapped model: CheckpointWrapper's prefix removed."""
    return name.replace(WRAPPED, "")


def full(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy of the whole tensor: a DTensor's full_tensor() (a collective: every rank calls it)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double().clone()


def full_params(model: nn.Module) -> Grads:
    return {plain_name(n): full(p) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> Grads:
    return {plain_name(n): full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def to_titan(seqs: Sequence[dict[str, list[int]]]) -> Batch:
    """torchtitan's batch: input tokens and next-token labels, right-padded (labels -100 on prompt and padding) to
    an even length, which ChunkedLossWrapper (2 chunks here) needs."""
    b = tiny_llama.collate(seqs)
    inputs, labels = b["input_ids"][:, :-1], b["labels"][:, 1:]
    odd = inputs.shape[1] % 2
    return ({"input": nn.functional.pad(inputs, (0, odd), value=tiny_llama.PAD)},
            nn.functional.pad(labels, (0, odd), value=-100))


def reference64(params: Grads) -> nn.Module:
    """torchtitan's model unparallelized in float64, holding ``params`` (RoPE's cache stays torchtitan's own)."""
    with torch.device("cpu"):
        model = tiny_config().build()
    model.init_weights(buffer_device=None)
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model  # type: ignore[no-any-return]


def token_sum_loss64(model: nn.Module, batch: Batch) -> torch.Tensor:
    """torchtitan's loss before its division, in float64: cross-entropy summed over the valid tokens (its own
    ``cross_entropy_loss`` would cast the logits to float32)."""
    inputs, labels = batch
    logits = model(inputs["input"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)


def truth(params: Grads, seqs: Sequence[dict[str, list[int]]]) -> tuple[Grads, float]:
    """float64 gradients of the token mean over ``seqs`` at ``params`` (one process, a sequence at a time); the mean."""
    model = reference64(copy.deepcopy(params))
    batches = [to_titan([s]) for s in seqs]
    total = sum(int((labels != -100).sum()) for _, labels in batches)
    loss = 0.0
    for batch in batches:
        term = token_sum_loss64(model, batch) / total
        term.backward()  # type: ignore[no-untyped-call]
        loss += float(term.detach())
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, loss


def clipped(grads: Grads, max_norm: float) -> tuple[Grads, float]:
    """torch's clip_grad_norm_ in float64: scale by min(1, max_norm / (norm + 1e-6)); the norm before clipping."""
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    scale = min(1.0, max_norm / (norm + 1e-6))
    return {n: g * scale for n, g in grads.items()}, norm
