"""Tensor parallelism for vLLM's models: their parallel layers laid out over the mesh's "tp" axis.

vLLM's models are written against its parallel layers (ColumnParallelLinear and its fused
QKV / merged gate-up forms, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead). vLLM sees
a tensor-parallel world of one process here (platform.py), so those layers hold whole weights
and compute the global values; this module gives each weight the layout vLLM's N processes would
each hold a slice of:

- column-parallel linears: the output dim over "tp" (weight dim 0, bias dim 0);
- row-parallel linears: the input dim over "tp" (weight dim 1);
- the same for an int8 weight-only layer's packed weight and its scales (quant.py): rows, or input
  columns (four to a packed word, whole groups of the per-group scales);
- the LM head: the vocabulary over "tp";
- embedding tables: the hidden dim over "tp" (a lookup then reads only local columns).

A fused column-parallel layer (QKV, gate-up) holds its parts one after the other, [q | k | v]:
split in N contiguous blocks, device i would hold rows of q alone (or of k and v alone), and the
model's split of the output into its parts would move activations between devices in every layer
(collective-permutes and all-gathers in the decode step). So its rows are stored shard-major, the
layout of vLLM's N processes: device i holds [q_i; k_i; v_i]. Its forward puts the output columns
back in the model's order with reshapes and slices that stay on each device, and the weights
vLLM's loaders wrote in the model's order are reordered once after loading
(`reorder_loaded_weights`).

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
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from torchtpu.distributed import empty as empty_on_mesh
from torchtpu.distributed.params import apply_layout, set_layout
from torchtpu.hardware import TP_AXIS

logger = init_logger(__name__)


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
    return init_device_mesh("tpu", (n,), mesh_dim_names=(TP_AXIS,), devices=devices[:n])


# A linear layer's parameters that hold its weight's rows (output channels) and columns (inputs): the
# plain weight, and int8 weight-only checkpoints' packed words [out, in / 4] and scales [out, groups]
# (quant.py). Per-channel scales [out, 1] have no column to split: the divisibility rule keeps them
# whole. `weight_shape` (the unpacked shape, two integers) is not a weight.
_WEIGHTS = ("weight", "weight_packed", "weight_scale")
# parameters whose rows a fused layer's shard-major order moves (reorder_loaded_weights)
_ROWS = ("weight", "weight_packed", "weight_scale", "bias")


def _split_dim(module: torch.nn.Module, name: str) -> int | None:
    if isinstance(module, ColumnParallelLinear):
        return 0 if name in _WEIGHTS or name == "bias" else None
    if isinstance(module, RowParallelLinear):
        return 1 if name in _WEIGHTS else None
    if isinstance(module, ParallelLMHead):
        return 0
    if isinstance(module, VocabParallelEmbedding):
        return 1
    return None


def _fused_parts(module: torch.nn.Module, n: int) -> list[int] | None:
    """The output sizes of a fused column-parallel layer whose parts the mesh divides, else None."""
    if not isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
        return None
    sizes = [int(s) for s in getattr(module, "output_sizes", ())]
    if len(sizes) < 2 or any(s % n for s in sizes) or (module.skip_bias_add and module.bias is not None):
        return None
    return sizes


def shard_major_rows(sizes: list[int], n: int) -> torch.Tensor:
    """For parts of `sizes` rows stored one after the other, the row order in which device i of n
    holds the i-th block of every part: stored row k is the model's row `order[k]`."""
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    return torch.cat(
        [
            torch.arange(start + i * (s // n), start + (i + 1) * (s // n))
            for i in range(n)
            for start, s in zip(starts, sizes)
        ]
    )


def model_order(out: torch.Tensor, sizes: list[int], n: int) -> torch.Tensor:
    """A shard-major fused layer's output, [..., (device, part block)], in the model's column
    order [..., part]: reshapes and slices along the local block, so nothing crosses devices."""
    blocks = out.unflatten(-1, (n, sum(sizes) // n))
    parts, start = [], 0
    for s in sizes:
        parts.append(blocks[..., start : start + s // n].flatten(-2))
        start += s // n
    return torch.cat(parts, dim=-1)


class _ModelOrderForward:
    """A fused layer's forward on shard-major weights, returning what the model's order gives."""

    def __init__(self, forward, sizes: list[int], n: int):
        self.forward, self.sizes, self.n = forward, sizes, n

    def __call__(self, input_):
        result = self.forward(input_)
        if isinstance(result, tuple):
            return (model_order(result[0], self.sizes, self.n), *result[1:])
        return model_order(result, self.sizes, self.n)


def reorder_loaded_weights(model: torch.nn.Module) -> None:
    """Put the fused layers' weights (and biases), which vLLM's loaders wrote in the model's row
    order, in the shard-major order their forward reads; once, after loading."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if not isinstance(forward, _ModelOrderForward):
            continue
        rows = shard_major_rows(forward.sizes, forward.n)
        for name in _ROWS:
            p = module._parameters.get(name)
            if p is not None:
                with torch.no_grad():
                    p.copy_(p.index_select(0, rows.to(p.device)))


def shard_model(model: torch.nn.Module, mesh) -> None:
    """Record and apply the tensor-parallel layout of every parallel layer's weights; fused layers
    get the shard-major row order (reorder_loaded_weights then reorders their loaded weights)."""
    n = mesh.size()
    for module in model.modules():
        sizes = _fused_parts(module, n)
        if sizes is not None:
            module.forward = _ModelOrderForward(module.forward, sizes, n)
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
            dims[dim] = [TP_AXIS]
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
