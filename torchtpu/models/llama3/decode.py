"""Cached autoregressive decoding for torchtitan's Llama 3 `Transformer`.

torchtitan's model has no KV cache: its forward recomputes attention over the whole sequence.
This module runs the same model, block by block, with its own submodules and weights
(tok_embeddings, attention_norm, wq/wk/wv/wo, torchtitan's `apply_rotary_emb`, ffn_norm,
feed_forward, norm, output), and changes only the attention step: the new positions' keys and
values are written into a preallocated cache, and the queries attend to every cached position up
to their own. So a prefill over the prompt and each one-token decode step compute exactly what a
full forward over the prefix computes at those positions.

    cache = KVCache.empty(model, batch=1, max_len=64, like=some_tpu_tensor)
    logits = forward_cached(model, tokens, start, cache)   # tokens (B, S), start: int64 scalar tensor

The cache length and the batch are fixed, and the start position is a tensor, so one compiled
program serves every decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["KVCache", "forward_cached"]


@dataclass
class KVCache:
    keys: list  # per layer: (B, max_len, n_kv_heads, head_dim)
    values: list

    @classmethod
    def empty(cls, model, batch: int, max_len: int, place) -> KVCache:
        """Zeros for every layer, each passed through `place` (e.g. to lay it out over a mesh)."""
        a = model.model_args
        n_kv = a.n_kv_heads or a.n_heads
        hd = a.dim // a.n_heads
        dtype = model.tok_embeddings.weight.dtype

        def zeros():
            return place(torch.zeros(batch, max_len, n_kv, hd, dtype=dtype))

        n = len(model.layers)
        return cls([zeros() for _ in range(n)], [zeros() for _ in range(n)])

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]


def _block(layer):
    """The transformer block inside an activation-checkpoint wrapper, if any."""
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def forward_cached(model, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, vocab) of the last of `tokens` (B, S), which sit at positions start..start+S-1;
    their keys and values are written into `cache` in place."""
    from torchtitan.models.llama3.model.model import apply_rotary_emb

    bsz, seqlen = tokens.shape
    positions = start + torch.arange(seqlen, device=tokens.device, dtype=start.dtype)
    key_pos = torch.arange(cache.max_len, device=tokens.device, dtype=start.dtype)
    visible = key_pos[None, :] <= positions[:, None]  # (S, max_len): causal over the cache
    h = model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers.values()):
        block = _block(layer)
        attn = block.attention
        hd = attn.head_dim
        x = block.attention_norm(h)
        q = attn.wq(x).view(bsz, seqlen, -1, hd)
        k = attn.wk(x).view(bsz, seqlen, -1, hd)
        v = attn.wv(x).view(bsz, seqlen, -1, hd)
        q, k = apply_rotary_emb(q, k, freqs_cis=model.freqs_cis, positions=positions[None, :])
        cache.keys[i].index_copy_(1, positions, k)
        cache.values[i].index_copy_(1, positions, v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            cache.keys[i].transpose(1, 2),
            cache.values[i].transpose(1, 2),
            attn_mask=visible,
            enable_gqa=attn.enable_gqa,
        )
        h = h + attn.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        h = h + block.feed_forward(block.ffn_norm(h))
    h = model.norm(h[:, -1, :])
    return model.output(h)
