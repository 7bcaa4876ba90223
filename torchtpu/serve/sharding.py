"""Tensor parallelism for vLLM's models: their parallel layers laid out over the mesh's "tp" axis.

vLLM's models are written against its parallel layers (ColumnParallelLinear and its fused
QKV / merged gate-up forms, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead). vLLM sees
a tensor-parallel world of one process here (platform.py), so those layers hold whole weights
and compute the global values; this module gives each weight the layout vLLM's N processes would
each hold a slice of:

- column-parallel linears: the output dim over "tp" (weight dim 0, bias dim 0);
- row-parallel linears: the input dim over "tp" (weight dim 1);
- the LM head: the vocabulary over "tp";
- embedding tables: the hidden dim over "tp" (a lookup then reads only local columns).

That is data for torchtpu's sharding layer (`torchtpu.distributed.params` layouts), applied to
the parameters while they are still unallocated, so the weight loaders write every tensor
straight into its shards. Everything else (norms, rotary tables) is replicated. XLA partitions
the step program and inserts the all-reduces that vLLM's row-parallel layers would issue.

A dim that the mesh does not divide stays whole (replicated), as vLLM replicates KV heads when
there are fewer of them than ranks.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from torchtpu.distributed import empty as empty_on_mesh
from torchtpu.distributed.params import apply_layout, set_layout

logger = init_logger(__name__)

AXIS = "tp"


def tensor_parallel_mesh(n: int):
    """The one-axis device mesh of the first `n` tpu devices (None for one device)."""
    if n <= 1:
        return None
    import jax

    from torchtpu.distributed import init_device_mesh

    devices = jax.devices()
    if n > len(devices):
        raise ValueError(
            f"tensor_parallel_size={n} but this host has {len(devices)} tpu devices; use at most {len(devices)} "
            "(on a CPU host, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    return init_device_mesh("tpu", (n,), mesh_dim_names=(AXIS,), devices=devices[:n])


def _split_dim(module: torch.nn.Module, name: str) -> int | None:
    if isinstance(module, ColumnParallelLinear):
        return 0
    if isinstance(module, RowParallelLinear):
        return 1 if name == "weight" else None
    if isinstance(module, ParallelLMHead):
        return 0
    if isinstance(module, VocabParallelEmbedding):
        return 1
    return None


def shard_model(model: torch.nn.Module, mesh) -> None:
    """Record and apply the tensor-parallel layout of every parallel layer's weights."""
    n = mesh.size()
    seen: dict[int, int | None] = {}
    for path, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            dim = _split_dim(module, name)
            if id(p) in seen:  # a tied weight (the LM head is the embedding): one layout, the first
                continue
            if dim is not None and p.shape[dim] % n != 0:
                logger.info(
                    "torchtpu: %s.%s %s stays whole (dim %d not divisible by %d)", path, name, tuple(p.shape), dim, n
                )
                dim = None
            seen[id(p)] = dim
            if dim is None:
                continue
            dims = [[] for _ in range(p.dim())]
            dims[dim] = [AXIS]
            set_layout(module, name, mesh, dims)
            apply_layout(module, name)


def kv_cache(shape: tuple, dtype: torch.dtype, mesh) -> torch.Tensor:
    """One layer's cache [num_blocks, block_size, 2 * kv_heads, head_dim], zeros, on tpu: split
    over the kv heads under tensor parallelism when the mesh divides them, else whole."""
    if mesh is None:
        return torch.zeros(shape, dtype=dtype, device="tpu")
    n = mesh.size()
    heads = shape[2] // 2
    placement = Shard(2) if heads % n == 0 else Replicate()
    return empty_on_mesh(shape, dtype, mesh=mesh, placements=[placement])
