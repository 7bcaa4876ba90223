"""Fused inference kernels that PyTorch's fast paths call on accelerator devices.

They have no decomposition, so each is written here as the sequence of ATen ops it fuses
(each of which is lowered); the fast paths only run without autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import bind, custom

aten = torch.ops.aten


@custom(aten._transformer_encoder_layer_fwd.default)
def transformer_encoder_layer_fwd(args, kwargs):
    a = bind(aten._transformer_encoder_layer_fwd.default, args, kwargs)
    src = a["src"]
    dim = a["embed_dim"]

    def attention(x):
        out, _ = torch.ops.aten._native_multi_head_attention(
            x,
            x,
            x,
            dim,
            a["num_heads"],
            a["qkv_weight"],
            a["qkv_bias"],
            a["proj_weight"],
            a["proj_bias"],
            a["mask"],
            False,
            True,
            a["mask_type"],
        )
        return out

    def norm(x, i):
        return F.layer_norm(x, (dim,), a[f"norm_weight_{i}"], a[f"norm_bias_{i}"], a["eps"])

    def feed_forward(x):
        h = F.linear(x, a["ffn_weight_1"], a["ffn_bias_1"])
        h = F.gelu(h) if a["use_gelu"] else F.relu(h)
        return F.linear(h, a["ffn_weight_2"], a["ffn_bias_2"])

    if a["norm_first"]:
        x = src + attention(norm(src, 1))
        return x + feed_forward(norm(x, 2))
    x = norm(src + attention(src), 1)
    return norm(x + feed_forward(x), 2)


@custom(aten._native_multi_head_attention.default)
def native_multi_head_attention(args, kwargs):
    a = bind(aten._native_multi_head_attention.default, args, kwargs)
    q_in, k_in, v_in = a["query"], a["key"], a["value"]
    dim, heads = a["embed_dim"], a["num_head"]
    mask, mask_type = a["mask"], a["mask_type"]
    need_weights, average = a["need_weights"], a["average_attn_weights"]
    wq, wk, wv = a["qkv_weight"].chunk(3, dim=0)
    bq, bk, bv = a["qkv_bias"].chunk(3, dim=0)
    unbatched = q_in.dim() == 2
    if unbatched:
        q_in, k_in, v_in = q_in.unsqueeze(0), k_in.unsqueeze(0), v_in.unsqueeze(0)
    b, lq, _ = q_in.shape
    lk = k_in.shape[1]
    hd = dim // heads

    def split(x, w, bias, n):
        return F.linear(x, w, bias).view(b, n, heads, hd).transpose(1, 2)

    q, k, v = split(q_in, wq, bq, lq), split(k_in, wk, bk, lk), split(v_in, wv, bv, lk)
    scores = (q @ k.transpose(-2, -1)) / (hd**0.5)
    if mask is not None:
        if mask_type == 1:  # key padding mask (B, Lk)
            mask = mask.view(b, 1, 1, lk)
        elif mask.dim() == 2:  # (Lq, Lk)
            mask = mask.view(1, 1, lq, lk)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(mask, float("-inf"))
        else:
            scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(b, lq, dim)
    out = F.linear(out, a["proj_weight"], a["proj_bias"])
    if unbatched:
        out = out.squeeze(0)
    if not need_weights:
        return out, torch.empty(0, dtype=out.dtype, device=out.device)
    if average:
        weights = weights.mean(dim=1)
    if unbatched:
        weights = weights.squeeze(0)
    return out, weights
