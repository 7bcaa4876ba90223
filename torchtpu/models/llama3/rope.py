"""Rotary position embedding in real arithmetic for torchtitan's Llama 3.

torchtitan keeps the rotary table as a complex64 buffer (`freqs_cis`) and rotates queries and
keys with `view_as_complex(x) * freqs_cis`. That is exact and portable, but on a TPU complex
numbers are emulated: a complex64 program input makes the TPU compiler split and recombine it
with 64-bit custom calls (after which XLA's cost model gives no step-time estimate), and each
`view_as_complex`/`view_as_real` pair becomes a layout copy of q and k in every layer.

`use_real_rope(model)` swaps both for real arithmetic, with the same numbers:

- the table becomes `view_as_real(freqs_cis)`: (cos, sin) per position and frequency, shape
  (max_seq_len, head_dim // 2, 2), float32 values stored as their int32 bit patterns. The bits
  are what keeps it float32: the table is passed to every block as a forward input, and mixed
  precision (FSDP's `cast_forward_inputs`) casts floating inputs to bf16, which a complex table
  escaped; an integer one escapes it too, and reading it back is a free bitcast. It stays a
  non-persistent buffer, so `state_dict()` and checkpoints are unchanged;
- each `Attention` module becomes a `RealRopeAttention` (a subclass: parameters, submodule
  names and tensor-parallel plans are unchanged) whose forward rotates each (even, odd) pair
  of a head as (x0 cos - x1 sin, x0 sin + x1 cos): the complex product written out.
"""

from __future__ import annotations

import torch

__all__ = ["RealRopeAttention", "apply_real_rotary_emb", "use_real_rope"]


def apply_real_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, rope_table: torch.Tensor):
    """Rotate (bs, seq, heads, head_dim) queries and keys by a (>= seq, head_dim // 2, 2) table.

    Computed in float32 and returned in the inputs' dtypes, as torchtitan's complex version does.
    """
    seqlen = xq.shape[1]
    if rope_table.shape[0] < seqlen:
        raise ValueError(
            f"the rotary table covers {rope_table.shape[0]} positions but the input has {seqlen}; "
            "build the model with max_seq_len >= the training seq_len"
        )
    if rope_table.dtype == torch.int32:
        rope_table = rope_table.view(torch.float32)
    if rope_table.dtype != torch.float32:
        # torchtitan's table is complex64, i.e. float32 parts: a bf16 copy would rotate less exactly
        raise ValueError(
            f"the rotary table (freqs_cis) is {rope_table.dtype}, not float32 (or its int32 bits); "
            "cast the model's parameters only, or call use_real_rope again after the cast"
        )
    table = rope_table[:seqlen]
    cos = table[..., 0][None, :, None, :]  # (1, seq, 1, head_dim // 2)
    sin = table[..., 1][None, :, None, :]

    def rotate(x):
        pairs = x.float().unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def _attention_class():
    from torchtitan.models.llama3.model.model import Attention

    return Attention


class RealRopeAttention(_attention_class()):
    """torchtitan's Llama 3 attention (SDPA) with the rotary embedding in real arithmetic."""

    def forward(self, x, freqs_cis, attention_masks=None, positions=None):
        if self.attn_type != "sdpa" or attention_masks is not None or positions is not None:
            raise NotImplementedError(
                f"RealRopeAttention supports SDPA attention without masks or positions (got attn_type="
                f"{self.attn_type!r}, masks {'given' if attention_masks is not None else 'none'}, positions "
                f"{'given' if positions is not None else 'none'}); leave the model's rotary embedding complex"
            )
        if freqs_cis.is_complex():  # a table rebuilt by torchtitan's own code
            freqs_cis = torch.view_as_real(freqs_cis)
        bs, seqlen, _ = x.shape
        # -1 heads: tensor parallelism may have split the projections' outputs
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_real_rotary_emb(xq, xk, freqs_cis)
        out = self.inner_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), enable_gqa=self.enable_gqa
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


def use_real_rope(model: torch.nn.Module) -> torch.nn.Module:
    """Give a torchtitan Llama 3 `Transformer` real rotary arithmetic, in place; returns it.

    Call before parallelizing or materializing (the model may be on `meta`). The table keeps
    its buffer name `freqs_cis`, and `model.init_weights()` rebuilds it real.
    """
    Attention = _attention_class()
    table = getattr(model, "freqs_cis", None)
    if table is None or not hasattr(model, "_precompute_freqs_cis"):
        raise TypeError(
            f"use_real_rope expects a torchtitan Llama 3 Transformer with a freqs_cis buffer, got "
            f"{type(model).__name__}"
        )
    complex_table = model._precompute_freqs_cis

    def precompute_real_table():
        return torch.view_as_real(complex_table()).contiguous().view(torch.int32)

    model._precompute_freqs_cis = precompute_real_table
    if table.dtype != torch.int32:
        if table.device.type == "meta":
            real = torch.empty(*table.shape, 2, dtype=torch.int32, device="meta")
        else:
            real = precompute_real_table().to(table.device)
        model.register_buffer("freqs_cis", real, persistent=False)
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = RealRopeAttention
    return model
