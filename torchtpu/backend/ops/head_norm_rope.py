"""`torchtpu::head_norm_rope`: a per-head RMS norm, then the rotary embedding, into head-major layout.

    out = torch.ops.torchtpu.head_norm_rope(x, weight, eps, rope, head_dim)

`x` is a projection's output (batch, seq, heads * head_dim); `weight` (head_dim,) or None and
`eps` are the norm's; `rope` is torchtitan's Qwen3 rotary table (at least seq rows of cos then sin,
2 * head_dim columns). `out` (batch, heads, seq, head_dim) is, with y = rms_norm(x viewed as
(batch, seq, heads, head_dim), (head_dim,), weight, eps):

    (y * cos + rotate_half(y) * sin).transpose(1, 2)

with cos and sin rounded to x's dtype first and each product and the sum in x's dtype: Qwen3's
query/key path (`q_norm`, `k_norm`, `apply_rotary_emb` and the transpose to attention's layout),
as torchtitan writes it, in one op. On CPU it runs as those PyTorch ops; its gradient is theirs.

On tpu the op lowers to one JAX function each way (the op is registered with `jax_op`, with
`head_norm_rope_backward` as its pullback, which its vjp op `torchtpu::head_norm_rope_vjp` runs):
XLA's fusions anywhere, and where the program is compiled for TPU
the Pallas kernels of head_norm_rope_tpu.py (one pass over the rows each way, written straight
into the head-major layout). The arithmetic is the same in both: float32 norm statistics with the
weight applied in float32 and one rounding (the rms_norm lowering's), then the rotation's products
and sum rounded to x's dtype one by one. The backward recomputes each row's 1/rms from x.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from ..registry import jax_op
from . import head_norm_rope_tpu


def _check(x, rope, head_dim):
    if x.dim() != 3 or x.shape[-1] % head_dim:
        raise ValueError(
            f"head_norm_rope: x of shape {tuple(x.shape)} is not (batch, seq, heads * head_dim) for head_dim {head_dim}"
        )
    if rope.dim() != 2 or rope.shape[0] < x.shape[1] or rope.shape[1] != 2 * head_dim:
        raise ValueError(
            f"head_norm_rope: the rotary table of shape {tuple(rope.shape)} does not cover {x.shape[1]} positions "
            f"x (cos, sin) of {head_dim}; build the model with max_seq_len >= the sequence length"
        )


# ----------------------------------------------------------------------------- PyTorch (CPU)


def _torch_forward(x, weight, eps, rope, head_dim):
    """The op as torchtitan's Qwen3 writes it (torchtitan.models.qwen3.model.model)."""
    _check(x, rope, head_dim)
    b, s, _ = x.shape
    y = torch.nn.functional.rms_norm(x.view(b, s, -1, head_dim), (head_dim,), weight, eps)
    table = rope[:s].view(1, s, 1, 2 * head_dim)
    cos = table[..., :head_dim].to(y.dtype)
    sin = table[..., head_dim:].to(y.dtype)
    half = head_dim // 2
    rotated = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return ((y * cos) + (rotated * sin)).transpose(1, 2).contiguous()


def _cpu_forward(x, weight, eps, rope, head_dim):
    return _torch_forward(x, weight, eps, rope, head_dim)


def _cpu_backward(x, weight, eps, rope, head_dim, grad):
    """(x's gradient, the weight's or None, none for the table)."""
    if weight is None:
        _, vjp = torch.func.vjp(lambda x: _torch_forward(x, None, eps, rope, head_dim), x)
        (gx,) = vjp(grad)
        return gx, None, None
    _, vjp = torch.func.vjp(lambda x, w: _torch_forward(x, w, eps, rope, head_dim), x, weight)
    gx, gw = vjp(grad)
    return gx, gw, None


def _fake(x, weight, eps, rope, head_dim):
    _check(x, rope, head_dim)
    b, s, width = x.shape
    return x.new_empty((b, width // head_dim, s, head_dim))


# ----------------------------------------------------------------------------- JAX


def _tables(x, rope, head_dim):
    s = x.shape[1]
    return rope[:s, :head_dim].astype(x.dtype), rope[:s, head_dim : 2 * head_dim].astype(x.dtype)


def _weight(weight, head_dim):
    return jnp.ones((head_dim,), jnp.float32) if weight is None else weight.astype(jnp.float32)


def _rnd(dtype):
    return lambda v: v.astype(dtype).astype(jnp.float32)


def _rotate_half(y):
    half = y.shape[-1] // 2
    return jnp.concatenate([-y[..., half:], y[..., :half]], axis=-1)


def _unrotate_half(v):
    """rotate_half's transpose: (v1, v2) -> (v2, -v1)."""
    half = v.shape[-1] // 2
    return jnp.concatenate([v[..., half:], -v[..., :half]], axis=-1)


def _xla_forward(x, w, cos, sin, head_dim, eps):
    b, s, width = x.shape
    rnd = _rnd(x.dtype)
    xf = x.reshape(b, s, width // head_dim, head_dim).astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = rnd(xf * r * w)
    c = cos.astype(jnp.float32)[None, :, None, :]
    sn = sin.astype(jnp.float32)[None, :, None, :]
    out = rnd(y * c) + rnd(_rotate_half(y) * sn)
    return out.astype(x.dtype).transpose(0, 2, 1, 3)


def _xla_backward(g, x, w, cos, sin, head_dim, eps):
    b, s, width = x.shape
    rnd = _rnd(x.dtype)
    gf = g.transpose(0, 2, 1, 3).astype(jnp.float32)  # (b, s, heads, head_dim)
    c = cos.astype(jnp.float32)[None, :, None, :]
    sn = sin.astype(jnp.float32)[None, :, None, :]
    dy = rnd(rnd(gf * c) + _unrotate_half(rnd(gf * sn)))
    xf = x.reshape(b, s, width // head_dim, head_dim).astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    gx = dy * w
    dot = jnp.sum(gx * xf, axis=-1, keepdims=True) / head_dim
    dx = (r * gx - xf * (r * r * r) * dot).astype(x.dtype).reshape(x.shape)
    return dx, jnp.sum(dy * xf * r, axis=(0, 1, 2))


def _on_tpu(kernel, xla, x, head_dim, operands):
    """`kernel` where the program is compiled for TPU (or in interpret mode, for tests), `xla`
    elsewhere and where the kernels do not apply (head_norm_rope_tpu.unsupported_reason)."""
    if head_norm_rope_tpu.unsupported_reason(x, head_dim) is not None:
        return xla(*operands)
    if head_norm_rope_tpu.interpreting():
        return kernel(*operands)
    return lax.platform_dependent(*operands, tpu=kernel, default=xla)


def head_norm_rope(x, weight, eps, rope, head_dim):
    cos, sin = _tables(x, rope, head_dim)
    w = _weight(weight, head_dim)

    def kernel(x, w, cos, sin):
        return head_norm_rope_tpu.forward(x, w, cos, sin, head_dim, eps)

    def xla(x, w, cos, sin):
        return _xla_forward(x, w, cos, sin, head_dim, eps)

    return _on_tpu(kernel, xla, x, head_dim, (x, w, cos, sin))


def head_norm_rope_backward(x, weight, eps, rope, head_dim, grad):
    """(x's gradient, the weight's float32 gradient or None, none for the table)."""
    cos, sin = _tables(x, rope, head_dim)
    w = _weight(weight, head_dim)

    def kernel(g, x, w, cos, sin):
        return head_norm_rope_tpu.backward(g, x, w, cos, sin, head_dim, eps)

    def xla(g, x, w, cos, sin):
        return _xla_backward(g, x, w, cos, sin, head_dim, eps)

    gx, gw = _on_tpu(kernel, xla, x, head_dim, (grad.astype(x.dtype), x, w, cos, sin))
    return gx, (gw if weight is not None else None), None


# Registered as users register a JAX function (backend/jax_op.py): the JAX forward and backward on
# tpu, each choosing its kernels or XLA's fusions itself (_on_tpu), PyTorch's ops on CPU.
jax_op(
    "torchtpu::head_norm_rope",
    head_norm_rope,
    schema="(Tensor x, Tensor? weight, float eps, Tensor rope, int head_dim) -> Tensor",
    backward=head_norm_rope_backward,
    fake=_fake,
    choose_platform=False,
    cpu=_cpu_forward,
    cpu_backward=_cpu_backward,
)
