"""A per-head RMS norm followed by the rotary embedding, into attention's head-major layout:
Pallas kernels for TPU, forward and backward.

What they compute is head_norm_rope.py's op (Qwen3's query/key path): each head of a projection's
output (batch, seq, heads * head_dim) normalized over its head_dim values (float32 statistics, the
weight applied in float32, one rounding, as rms_norm_tpu.py's kernels do), then rotated as
torchtitan's Qwen3 `apply_rotary_emb` does in the input's dtype (x * cos + rotate_half(x) * sin,
each product and the sum rounded to that dtype, cos and sin rounded to it first), and written as
(batch, heads, seq, head_dim), the layout the flash-attention kernels read. The backward takes the
gradient in that layout and gives the projection output's (and the norm weight's) gradient,
recomputing the 1/rms of each row from the input it reads anyway.

Left to XLA, the norm, the rotation (rotate_half's slices and concatenation split each row at
half its lanes) and the transposition to head-major run as several fusions and layout copies per
layer, forward, recomputation and backward; each kernel is one pass over the rows. `rotate_half`
is a lane rotation by head_dim / 2 and a sign (`pltpu.roll`).

Blocks: a grid step holds `block` positions of one sequence, every head of them (a (block,
heads * head_dim) slab of the input, a (heads, block, head_dim) slab of the output) and the
positions' (block, head_dim) rows of cos and sin; the heads are a loop inside. Where they apply
(`unsupported_reason`): head_dim of 128 or 256, float32 or bfloat16, a sequence length with a
block of a multiple of 128 positions dividing it, and 128 positions of every head within 2 MiB. Sharding: per shard under `jax.shard_map`, the
batch split over every mesh axis (as rms_norm_tpu.py); a tensor-parallel "tp" axis, or a batch the
mesh does not divide, keeps the XLA lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..pallas_mode import interpreting
from .rms_norm_tpu import batch_split, per_batch_shard

__all__ = ["unsupported_reason", "forward", "backward", "KERNEL_NAMES"]

KERNEL_NAMES = {"forward": "torchtpu_head_norm_rope", "backward": "torchtpu_head_norm_rope_bwd"}
_LANES = 128
_HEAD_DIMS = (128, 256)
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_SLAB_BYTES = 2 << 20  # one grid step's input slab (positions x heads x head_dim), at most
_MAX_BLOCK = 512  # positions per grid step, at most (the heads' float32 temporaries in VMEM)


def _block(seq: int, width: int, itemsize: int) -> int | None:
    """Positions per grid step: the largest multiple of 128 up to _MAX_BLOCK dividing `seq` whose
    slab fits _SLAB_BYTES, or None when 128 does not divide `seq` or 128 positions' slab does not fit
    (the backward double-buffers three slabs in scoped VMEM)."""
    if seq % _LANES or _LANES * width * itemsize > _SLAB_BYTES:
        return None
    best = _LANES
    p = _LANES
    while p <= min(seq, _MAX_BLOCK):
        if seq % p == 0 and p * width * itemsize <= _SLAB_BYTES:
            best = p
        p += _LANES
    return best


def unsupported_reason(x, head_dim: int) -> str | None:
    """Why the kernels cannot take `x` (batch, seq, heads * head_dim), or None."""
    if x.ndim != 3 or x.shape[2] % head_dim:
        return f"the input {tuple(x.shape)} is not (batch, seq, heads * {head_dim})"
    if head_dim not in _HEAD_DIMS:
        return f"head_dim {head_dim} (the kernels take {' or '.join(map(str, _HEAD_DIMS))})"
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(x.dtype)} (the kernels take float32 or bfloat16)"
    if x.shape[1] % _LANES:
        return f"a sequence length of {x.shape[1]}, not a multiple of 128"
    if _block(x.shape[1], x.shape[2], jnp.dtype(x.dtype).itemsize) is None:
        return f"{x.shape[2]} values per position: 128 positions of them exceed a block's {_SLAB_BYTES >> 20} MiB"
    if batch_split(x) is None:
        return "a tensor-parallel mesh axis, or a batch the mesh does not divide"
    return None


# ----------------------------------------------------------------------------- kernels


def _rounding(dtype):
    """Rounds float32 values to `dtype` and back: what one operation in that dtype gives."""
    return lambda v: v.astype(dtype).astype(jnp.float32)


def _sign(head_dim):
    """-1 on the first half of a head's lanes, +1 on the second: rotate_half(y) = roll * sign."""
    lane = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    return jnp.where(lane < head_dim // 2, -1.0, 1.0).astype(jnp.float32)


def _operands(w_ref, cos_ref, sin_ref, head_dim):
    """A grid step's weight and cos, sin rows in float32, and rotate_half's sign."""
    f32 = jnp.float32
    return w_ref[...].astype(f32), cos_ref[...].astype(f32), sin_ref[...].astype(f32), _sign(head_dim)


def _forward_kernel(x_ref, w_ref, cos_ref, sin_ref, o_ref, *, heads, head_dim, eps):
    rnd = _rounding(o_ref.dtype)
    w, c, s, sign = _operands(w_ref, cos_ref, sin_ref, head_dim)

    def head(h, carry):
        lanes = pl.ds(pl.multiple_of(h * head_dim, _LANES), head_dim)
        x = x_ref[0, :, lanes].astype(jnp.float32)  # (block, head_dim)
        r = lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
        y = rnd(x * r * w)
        rotated = pltpu.roll(y, head_dim // 2, 1) * sign
        o_ref[0, h] = (rnd(y * c) + rnd(rotated * s)).astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, heads, head, 0)


def _backward_kernel(g_ref, x_ref, w_ref, cos_ref, sin_ref, dx_ref, dw_ref, *, heads, head_dim, eps):
    rnd = _rounding(dx_ref.dtype)
    w, c, s, sign = _operands(w_ref, cos_ref, sin_ref, head_dim)

    def head(h, dw):
        lanes = pl.ds(pl.multiple_of(h * head_dim, _LANES), head_dim)
        g = g_ref[0, h].astype(jnp.float32)  # (block, head_dim)
        # the rotation's gradient: g cos, plus rotate_half's transpose of g sin
        gs = rnd(g * s)
        dy = rnd(rnd(g * c) + pltpu.roll(gs, head_dim // 2, 1) * -sign)
        x = x_ref[0, :, lanes].astype(jnp.float32)
        r = lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
        gx = dy * w
        dot = jnp.sum(gx * x, axis=1, keepdims=True) / head_dim
        dx_ref[0, :, lanes] = (r * gx - x * (r * r * r) * dot).astype(dx_ref.dtype)
        return dw + jnp.sum(dy * x * r, axis=0, keepdims=True)

    dw = lax.fori_loop(0, heads, head, jnp.zeros((1, head_dim), jnp.float32))
    first = lax.broadcasted_iota(jnp.int32, (8, 1), 0) == 0  # this step's share in the first of 8 rows
    dw_ref[...] = jnp.where(first, jnp.broadcast_to(dw, (8, head_dim)), 0.0)


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


def _specs(x, head_dim):
    batch, seq, width = x.shape
    heads = width // head_dim
    p = _block(seq, width, x.dtype.itemsize)
    rows = pl.BlockSpec((1, p, width), lambda b, i: (b, i, 0))
    table = pl.BlockSpec((p, head_dim), lambda b, i: (i, 0))
    weight = pl.BlockSpec((1, head_dim), lambda b, i: (0, 0))
    head_major = pl.BlockSpec((1, heads, p, head_dim), lambda b, i: (b, 0, i, 0))
    return heads, p, rows, table, weight, head_major


def _forward_local(x, w, cos, sin, head_dim, eps):
    """x (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim) in x's dtype."""
    batch, seq, width = x.shape
    heads, p, rows, table, weight, head_major = _specs(x, head_dim)
    nbytes = 2 * x.size * x.dtype.itemsize + 2 * seq * head_dim * cos.dtype.itemsize
    with jax.enable_x64(False):  # Mosaic index maps are 32-bit
        return pl.pallas_call(
            functools.partial(_forward_kernel, heads=heads, head_dim=head_dim, eps=eps),
            grid=(batch, seq // p),
            in_specs=[rows, weight, table, table],
            out_specs=head_major,
            out_shape=jax.ShapeDtypeStruct((batch, heads, seq, head_dim), x.dtype),
            cost_estimate=pl.CostEstimate(flops=10 * x.size, transcendentals=x.size // head_dim, bytes_accessed=nbytes),
            compiler_params=_params(),
            interpret=interpreting(),
            name=KERNEL_NAMES["forward"],
        )(x, w.reshape(1, head_dim), cos, sin)


def _backward_local(g, x, w, cos, sin, head_dim, eps):
    """g (batch, heads, seq, head_dim), x (batch, seq, heads * head_dim) -> (x's gradient, the
    weight's gradient (1, head_dim) float32)."""
    batch, seq, width = x.shape
    heads, p, rows, table, weight, head_major = _specs(x, head_dim)
    steps = seq // p
    share = pl.BlockSpec((8, head_dim), lambda b, i: (b * steps + i, 0))
    nbytes = x.size * (g.dtype.itemsize + 2 * x.dtype.itemsize) + 2 * seq * head_dim * cos.dtype.itemsize
    with jax.enable_x64(False):
        dx, dw = pl.pallas_call(
            functools.partial(_backward_kernel, heads=heads, head_dim=head_dim, eps=eps),
            grid=(batch, steps),
            in_specs=[head_major, rows, weight, table, table],
            out_specs=[rows, share],
            out_shape=[
                jax.ShapeDtypeStruct(x.shape, x.dtype),
                jax.ShapeDtypeStruct((8 * batch * steps, head_dim), jnp.float32),
            ],
            cost_estimate=pl.CostEstimate(flops=16 * x.size, transcendentals=x.size // head_dim, bytes_accessed=nbytes),
            compiler_params=_params(),
            interpret=interpreting(),
            name=KERNEL_NAMES["backward"],
        )(g, x, w.reshape(1, head_dim), cos, sin)
    return dx, jnp.sum(dw, axis=0, keepdims=True)


# ----------------------------------------------------------------------------- per shard


def forward(x, weight, cos, sin, head_dim: int, eps: float):
    """The op's output (batch, heads, seq, head_dim) from x (batch, seq, heads * head_dim), the
    norm weight (head_dim,) and cos, sin (seq, head_dim) already in x's dtype."""

    def local(x, w, c, s):
        return (_forward_local(x, w, c, s, head_dim, eps),)

    operands = (x, weight.astype(jnp.float32), cos, sin)
    return per_batch_shard(local, x, operands, (True, False, False, False), (True,))[0]


def backward(grad, x, weight, cos, sin, head_dim: int, eps: float):
    """(x's gradient in x's dtype, the weight's gradient float32 (head_dim,)) of `forward`."""

    def local(g, x, w, c, s):
        return _backward_local(g, x, w, c, s, head_dim, eps)

    operands = (grad, x, weight.astype(jnp.float32), cos, sin)
    dx, dw = per_batch_shard(local, x, operands, (True, True, False, False, False), (True, True))
    return dx, jnp.sum(dw, axis=0)
