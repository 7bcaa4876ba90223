"""Qwen3's attention with its query/key path as one op: `NormRopeAttention`.

torchtitan's Qwen3 `Attention.forward` normalizes each query and key head (`q_norm`, `k_norm`),
rotates them (`apply_rotary_emb`: x * cos + rotate_half(x) * sin) and transposes them to
(batch, heads, seq, head_dim) for attention. `use_norm_rope_attention(model)` makes each such
module a `NormRopeAttention` (a subclass: parameters, submodule names and parallelize plans are
unchanged) whose forward runs those steps for the queries and for the keys as one op each,
`torchtpu::head_norm_rope` (backend/ops/head_norm_rope.py): on CPU the same PyTorch ops, on tpu
one JAX function each way, and on TPU a Pallas kernel each way that writes attention's layout
directly. The numbers are torchtitan's (the op's doc says how they are rounded).

The forward is torchtitan's otherwise: the same projections in the same order (per-op activation
checkpointing counts them), SDPA with the module's scale and grouped-query setting, the output
projection. Where the op does not apply (another attention type, masks, explicit positions, no
q/k norm, a norm without an eps) the module runs torchtitan's own forward.
"""

from __future__ import annotations

import torch

__all__ = ["NormRopeAttention", "use_norm_rope_attention"]


def _attention_class():
    from torchtitan.models.qwen3.model.model import Attention

    return Attention


class NormRopeAttention(_attention_class()):
    """torchtitan's Qwen3 attention with each of its query and key paths (norm, rotary embedding,
    transpose) as one `torchtpu::head_norm_rope` op."""

    def _fused(self, attention_masks, positions) -> bool:
        return (
            self.attn_type == "sdpa"
            and attention_masks is None
            and positions is None
            and self.q_norm is not None
            and self.k_norm is not None
            and self.q_norm.eps is not None
            and self.k_norm.eps is not None
        )

    def forward(self, x, rope_cache, attention_masks=None, positions=None):
        if not self._fused(attention_masks, positions):
            return super().forward(x, rope_cache, attention_masks, positions)
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        q = torch.ops.torchtpu.head_norm_rope(xq, self.q_norm.weight, self.q_norm.eps, rope_cache, self.head_dim)
        k = torch.ops.torchtpu.head_norm_rope(xk, self.k_norm.weight, self.k_norm.eps, rope_cache, self.head_dim)
        v = xv.view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        out = self.inner_attention(q, k, v, scale=self.scaling, enable_gqa=self.enable_gqa)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


def use_norm_rope_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Make each torchtitan Qwen3 `Attention` of `model` a `NormRopeAttention`, in place; returns it."""
    Attention = _attention_class()
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = NormRopeAttention
    return model
