"""torchtitan's Llama 4 on tpu: preparation and parallelize plan.

The model is torchtitan's Llama 4 `Transformer`: grouped-query attention with the Llama 3 module
names, Mixture-of-Experts feed-forward in every `interleave_moe_layer_step`-th block (the others
dense), each MoE layer with a shared expert, sigmoid top-k routing whose score scales the routed
expert's input, and the auxiliary-loss-free load balancing (`expert_bias`, moved before every
optimizer step by the trainer: `ModelFamily.moe_load_balancing`).

`prepare_llama4(model)` changes two things, the numbers staying the same: the rotary table becomes
real (torchtpu.models.llama3.rope, as for Llama 3) and each `Attention` a `RealRopeLlama4Attention`
(a subclass, same parameters and names) that rotates in real arithmetic, and skips the rotation in
the NoPE layers as torchtitan's does; the routed experts run as grouped matmuls on unpadded groups
(torchtpu.models.moe).

The plan (torchtpu.models.moe.parallelize_moe_family) is torchtitan's: the Llama 3 plan for the
attention, the dense feed-forward and the embeddings (tensor parallelism with sequence parallelism),
torchtitan's plan for the MoE layers (expert parallelism, tensor parallelism of the router and the
shared and routed experts), FSDP/HSDP per block with mixed precision, activation checkpointing, and
the layer scan when every block is built alike (`uniform_blocks`: 17bx16e). Refused with one line: the iRoPE flavors (NoPE layers plus chunked attention, whose fixed-block
masks torchtitan builds for flex_attention).
"""

from __future__ import annotations

import torch

from ..llama3.rope import apply_real_rotary_emb, use_real_rope
from ..moe import parallelize_moe_family, use_ragged_experts

__all__ = ["RealRopeLlama4Attention", "parallelize_llama4", "prepare_llama4", "uniform_blocks"]


def _model_module():
    from torchtitan.models.llama4.model import model

    return model


class RealRopeLlama4Attention(_model_module().Attention):
    """torchtitan's Llama 4 attention (SDPA, causal) with the rotary embedding in real arithmetic."""

    def forward(self, x, freqs_cis, attention_masks=None, positions=None):
        if self.attn_type != "sdpa" or attention_masks is not None or positions is not None:
            raise NotImplementedError(
                f"Llama 4 attention on tpu runs SDPA without masks or positions (got attn_type={self.attn_type!r}); "
                "use a flavor without iRoPE"
            )
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.use_rope:
            if freqs_cis.is_complex():
                freqs_cis = torch.view_as_real(freqs_cis)
            xq, xk = apply_real_rotary_emb(xq, xk, freqs_cis)
        out = self.inner_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), enable_gqa=self.enable_gqa
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


def prepare_llama4(model: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's Llama 4 Transformer ready for tpu (real rotary arithmetic, experts as grouped
    matmuls on unpadded groups), in place; returns it. The model may be on `meta`."""
    m = _model_module()
    if type(model) is not m.Transformer:
        raise TypeError(f"prepare_llama4 expects torchtitan's Llama 4 Transformer, got {type(model).__name__}")
    use_real_rope(model)  # the table (and its rebuild in init_weights); Llama 3's attention class is not here
    for module in model.modules():
        if type(module) is m.Attention:
            module.__class__ = RealRopeLlama4Attention
    return use_ragged_experts(model)


def uniform_blocks(model: torch.nn.Module) -> bool:
    """Whether every block of a torchtitan Llama 4 Transformer is built alike: all MoE or all dense
    (`moe_enabled`: every `interleave_moe_layer_step`-th block is MoE) and all with rotary embedding
    or all without (`use_rope`: every `every_n_layers_nope`-th block is a NoPE one). True for 17bx16e
    (interleave_moe_layer_step 1, no NoPE layers); False for the flavors that interleave dense and
    MoE blocks (debugmodel, 17bx128e) and the iRoPE ones."""
    return len({(block.moe_enabled, block.attention.use_rope) for block in model.layers.values()}) <= 1


def parallelize_llama4(model: torch.nn.Module, mesh, **kw) -> torch.nn.Module:
    """Shard a torchtitan Llama 4 Transformer over `mesh`; the arguments are parallelize_llama's.
    The layer scan (`scan_layers`) runs the blocks when they are all built alike (`uniform_blocks`:
    17bx16e, every block MoE with rotary embedding); otherwise they run unrolled, each under the
    activation checkpointing asked for: dense and MoE blocks interleave, and blocks without rotary
    embedding (`use_rope`) differ from the others in an attribute the layer scan's check of
    identical blocks does not see."""
    if not uniform_blocks(model):
        kw["scan_layers"] = False
    return parallelize_moe_family(model, mesh, **kw)
