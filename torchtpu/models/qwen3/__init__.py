"""torchtitan's Qwen3 (dense and Mixture-of-Experts) on tpu: preparation and parallelize plan.

Qwen3's blocks use the module names Llama 3's do (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3,
attention_norm, ffn_norm; tok_embeddings, norm, output), and its per-head q/k norms act on whole
heads, so the Llama 3 plan (torchtpu.models.llama3.parallelize) shards it: tensor parallelism
over heads and the feed-forward, FSDP per block, mixed precision, activation checkpointing, the
layer scan (the Mixture-of-Experts blocks too: the scan carries their load-statistics buffers).
Its rotary table is real already (cos and sin), so nothing like Llama 3's real-RoPE swap is needed;
`prepare_qwen3` runs each attention's query/key norm, rotary embedding and transpose as one op
(`use_norm_rope_attention`, attention.py), the same numbers.

The Mixture-of-Experts flavors take torchtitan's plan for their MoE layers (torchtpu.models.moe):
expert parallelism (`apply_expert_parallel`) when the job's mesh has an "ep" dim, and tensor
parallelism (`apply_moe_tp`): the router replicated, the routed experts split on their hidden dim
without expert parallelism, and with it whole, expert parallelism taking the tensor-parallel ranks
(expert_tensor_parallel_degree 1). Refused with one line: tensor parallelism for a flavor whose
output projection is the embedding table (weight tying: the two layouts conflict).
"""

from __future__ import annotations

import torch

from ...hardware import TP_AXIS
from ..llama3.parallelize import parallelize_llama
from ..moe import parallelize_moe_family, use_ragged_experts
from .attention import use_norm_rope_attention

__all__ = ["parallelize_qwen3", "prepare_qwen3"]


def prepare_qwen3(model: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's Qwen3Model ready for tpu: its experts (if any) run as grouped matmuls on
    unpadded groups (torchtpu.models.moe), and each attention's query/key path as one op
    (attention.py)."""
    return use_norm_rope_attention(use_ragged_experts(model))


def parallelize_qwen3(model: torch.nn.Module, mesh, **kw) -> torch.nn.Module:
    """Shard a torchtitan Qwen3Model over `mesh`; the arguments are parallelize_llama's."""
    args = model.model_args
    if TP_AXIS in mesh.mesh_dim_names and mesh.size(TP_AXIS) > 1:
        if args.enable_weight_tying:
            raise ValueError(
                f"tensor parallel degree {mesh.size(TP_AXIS)}: this Qwen3 flavor ties its output projection to "
                "the embedding table, which tensor parallelism splits two ways; set "
                "parallelism.tensor_parallel_degree = 1 or use a flavor of 8B or more"
            )
    if args.moe_enabled:
        # expert parallelism, torchtitan's tensor-parallel plan for the MoE layers, the Llama 3 plan
        # for the rest: the plan every MoE family shares
        return parallelize_moe_family(model, mesh, **kw)
    return parallelize_llama(model, mesh, **kw)
