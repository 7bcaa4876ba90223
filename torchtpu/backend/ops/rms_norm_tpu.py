"""RMS norm over a narrow last dim on TPU: Pallas kernels for its forward and its backward.

`torch.nn.RMSNorm` / `F.rms_norm` on tpu reach `aten._fused_rms_norm` and
`aten._fused_rms_norm_backward` (nn_norm.py registers rms_norm's autograd kernel for the tpu
device, so its backward is one op, as on CUDA, instead of the composite's pieces). When the
program is compiled for TPU, nn_norm.py routes the norms these kernels take here
(`jax.lax.platform_dependent`, as attention does); every other platform, and every other norm,
keeps the XLA lowering. The arithmetic is the same: float32 statistics, the weight applied in
float32, one rounding to the input's dtype.

What they are for: per-head query/key norms, as Qwen3's (a norm over each head's
128 values of a (batch, seq, heads, head_dim) view of a projection's output), where the model calls
`F.rms_norm` for them (transformers' Qwen3 on tpu; torchtitan's Qwen3 attention runs its norm, rotary
embedding and transpose as one op instead, head_norm_rope.py). Left to XLA, such
a norm runs as several fusions over that view's layout with float32 intermediates between
them; the kernels make one pass over the rows each way. At commit 82e2573, Qwen3 30B-A3B's
estimated layer on v5p:2x2x4 is 88.11 ms with them, 90.09 ms with its query/key norms run as
PyTorch's composite ops (`python -m bench.step_estimate`). A hidden-size norm
(2048 to 16384 values) stays XLA's: XLA sums its rows' squares in the same pass as the residual
add that produces them (one fusion writing the sum and the new residual), which a kernel, a pass
of its own, cannot share (Llama 3 8B's layer: 47.60 ms with the kernels on its hidden norms,
47.38 without; Qwen3 30B-A3B's: 88.18 against 88.11; both at commit 82e2573).

Each kernel reads a block of rows (up to 1 MiB of them in float32) once: the forward writes the
normalized rows and each row's 1/rms (as one lane-dense row of float32, the statistic the
backward reads), the backward the input's gradient and, per block, the block's share of the
weight's gradient (summed over the blocks outside). Where they apply (`unsupported_reason`): the
norm is over the last dim alone, of 128 or 256 values, float32 or bfloat16, and the rows fit one
block or split into blocks of a multiple of 128 rows. Sharding: a Mosaic kernel is a custom call
XLA cannot partition, so over a device mesh it runs per shard under `jax.shard_map`, the leading
dim split over every mesh axis (the batch dim, as FSDP and data parallelism lay activations
out). Where a tensor-parallel "tp" axis splits the mesh (heads over "tp"), or the leading dim
does not divide, the XLA lowering runs instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from ...hardware import TP_AXIS
from ..pallas_mode import interpreting, mesh_of

__all__ = ["unsupported_reason", "forward", "backward", "KERNEL_NAMES", "batch_split", "per_batch_shard"]

KERNEL_NAMES = {"forward": "torchtpu_rms_norm", "backward": "torchtpu_rms_norm_bwd"}
_LANES = 128
_BLOCK_BYTES = 1 << 20  # a block's rows in float32 (at least 128 rows)
_MAX_DIM = 256  # per-head norms (the module doc says why not wider ones)
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _block_rows(rows: int, dim: int) -> int | None:
    """Rows per block: all of them if they fit, else the largest multiple of 128 within
    _BLOCK_BYTES that divides `rows`; None if none does."""
    if rows * dim * 4 <= _BLOCK_BYTES:
        return rows
    br = _BLOCK_BYTES // (dim * 4) // _LANES * _LANES
    while br >= _LANES:
        if rows % br == 0:
            return br
        br -= _LANES
    return None


def batch_split(x):
    """(mesh, the PartitionSpec entry splitting the leading dim, the number of shards) for `x`
    inside a program over a mesh; (None, None, 1) without one; None where a per-row kernel should
    not run (see the module doc). head_norm_rope_tpu.py splits its kernels the same way."""
    mesh = mesh_of(x)
    if mesh is None:
        return None, None, 1
    sizes = dict(mesh.shape)
    if sizes.get(TP_AXIS, 1) > 1:
        return None
    axes = tuple(a for a in mesh.axis_names if sizes[a] > 1)
    shards = math.prod(sizes[a] for a in axes)
    if x.shape[0] % shards:
        return None
    return mesh, axes[0] if len(axes) == 1 else axes, shards


def unsupported_reason(x, normalized_shape) -> str | None:
    """Why the kernels cannot normalize `x` (a traced array) over `normalized_shape`, or None."""
    if len(normalized_shape) != 1 or x.ndim == 0:
        return "the norm is over more than the last dim"
    dim = x.shape[-1]
    if dim % _LANES or dim > _MAX_DIM:
        return f"the normalized dim {dim} is not 128 or 256 (the kernels take per-head norms)"
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(x.dtype)} (the kernels take float32 or bfloat16)"
    where = batch_split(x)
    if where is None:
        return "a tensor-parallel mesh axis, or a leading dim the mesh does not divide"
    if _block_rows(math.prod(x.shape[:-1]) // where[2], dim) is None:
        return "no block of a multiple of 128 rows divides the rows"
    return None


# ----------------------------------------------------------------------------- kernels


def _forward_kernel(x_ref, *refs, eps, has_weight):
    w_ref, (y_ref, r_ref) = (refs[0], refs[1:]) if has_weight else (None, refs)
    x = x_ref[...].astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)  # (rows, 1)
    y = x * r
    if w_ref is not None:
        y = y * w_ref[...].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)
    r_ref[...] = jnp.broadcast_to(r, (r.shape[0], _LANES)).T[:1, :]  # the column as one row


def _backward_kernel(g_ref, x_ref, r_ref, *refs, has_weight):
    w_ref, gi_ref, gw_ref = refs if has_weight else (None, refs[0], None)
    g = g_ref[...].astype(jnp.float32)
    x = x_ref[...].astype(jnp.float32)
    r = jnp.broadcast_to(r_ref[...], (_LANES, r_ref.shape[1])).T[:, :1]  # the row as a column
    gx = g * w_ref[...].astype(jnp.float32) if w_ref is not None else g
    dot = jnp.sum(gx * x, axis=1, keepdims=True) / x.shape[1]
    gi_ref[...] = (r * gx - x * (r * r * r) * dot).astype(gi_ref.dtype)
    if gw_ref is not None:  # this block's share, in the first of 8 rows (an (8, dim) tile)
        share = jnp.sum(g * x * r, axis=0, keepdims=True)
        first = lax.broadcasted_iota(jnp.int32, (8, 1), 0) == 0
        gw_ref[...] = jnp.where(first, jnp.broadcast_to(share, (8, share.shape[1])), 0.0)


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel",))


def _forward_rows(x, w, eps):
    """x (rows, dim) -> (y (rows, dim) in x's dtype, 1/rms (1, rows) float32)."""
    rows, dim = x.shape
    br = _block_rows(rows, dim)
    block = pl.BlockSpec((br, dim), lambda i: (i, 0))
    whole = pl.BlockSpec((1, dim), lambda i: (0, 0))
    stat = pl.BlockSpec((1, br), lambda i: (0, i))
    has_weight = w is not None
    operands = (x,) + ((w.reshape(1, dim),) if has_weight else ())
    nbytes = 2 * rows * dim * x.dtype.itemsize + 4 * rows
    with jax.enable_x64(False):  # Mosaic index maps are 32-bit
        return pl.pallas_call(
            functools.partial(_forward_kernel, eps=eps, has_weight=has_weight),
            grid=(rows // br,),
            in_specs=[block] + ([whole] if has_weight else []),
            out_specs=[block, stat],
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((1, rows), jnp.float32)],
            cost_estimate=pl.CostEstimate(flops=4 * rows * dim, transcendentals=rows, bytes_accessed=nbytes),
            compiler_params=_params(),
            interpret=interpreting(),
            name=KERNEL_NAMES["forward"],
        )(*operands)


def _backward_rows(g, x, r, w):
    """g, x (rows, dim), r (1, rows) -> (x's gradient in x's dtype, w's gradient float32 or None)."""
    rows, dim = x.shape
    br = _block_rows(rows, dim)
    blocks = rows // br
    block = pl.BlockSpec((br, dim), lambda i: (i, 0))
    whole = pl.BlockSpec((1, dim), lambda i: (0, 0))
    stat = pl.BlockSpec((1, br), lambda i: (0, i))
    has_weight = w is not None
    out_specs = [block] + ([pl.BlockSpec((8, dim), lambda i: (i, 0))] if has_weight else [])
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_shape += [jax.ShapeDtypeStruct((8 * blocks, dim), jnp.float32)] if has_weight else []
    operands = (g, x, r) + ((w.reshape(1, dim),) if has_weight else ())
    nbytes = rows * dim * (g.dtype.itemsize + 2 * x.dtype.itemsize) + 4 * rows
    with jax.enable_x64(False):
        outs = pl.pallas_call(
            functools.partial(_backward_kernel, has_weight=has_weight),
            grid=(blocks,),
            in_specs=[block, block, stat] + ([whole] if has_weight else []),
            out_specs=out_specs,
            out_shape=out_shape,
            cost_estimate=pl.CostEstimate(flops=10 * rows * dim, transcendentals=0, bytes_accessed=nbytes),
            compiler_params=_params(),
            interpret=interpreting(),
            name=KERNEL_NAMES["backward"],
        )(*operands)
    return outs[0], (jnp.sum(outs[1], axis=0) if has_weight else None)


# ----------------------------------------------------------------------------- per shard


def per_batch_shard(fn, x, operands, specs, out_specs):
    """`fn(*operands)` per shard of `x`'s leading dim (`batch_split`): operands and results whose
    entry in `specs` / `out_specs` is true are split with it, the others replicated."""
    mesh, entry, _ = batch_split(x)
    if mesh is None:
        return fn(*operands)
    spec = lambda s: P(entry) if s else P()  # noqa: E731
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tuple(spec(s) for s in specs),
        out_specs=tuple(spec(s) for s in out_specs),
        check_vma=False,
    )(*operands)


def forward(x, weight, eps: float):
    """RMS norm of `x` over its last dim (weight (dim,) or None): (out in x's dtype, 1/rms
    float32 shaped x.shape[:-1] + (1,)), what `aten._fused_rms_norm` returns."""
    dim = x.shape[-1]

    def local(x, *w):
        y, r = _forward_rows(x.reshape(-1, dim), w[0] if w else None, eps)
        return y.reshape(x.shape), r.reshape(x.shape[:-1] + (1,))

    operands = (x,) + ((weight,) if weight is not None else ())
    return per_batch_shard(local, x, operands, (True,) + (False,) * (len(operands) - 1), (True, True))


def backward(grad_out, x, rstd, weight):
    """(x's gradient in x's dtype, the weight's gradient float32 or None) of `forward`, from
    its 1/rms `rstd` (x.shape[:-1] + (1,), float32)."""
    dim = x.shape[-1]
    has_weight = weight is not None

    def local(g, x, r, *w):
        rows = math.prod(x.shape[:-1])
        gi, gw = _backward_rows(g.reshape(rows, dim), x.reshape(rows, dim), r.reshape(1, rows), w[0] if w else None)
        return gi.reshape(x.shape), (gw[None] if has_weight else jnp.zeros((1, dim), jnp.float32))

    operands = (grad_out, x, rstd.astype(jnp.float32)) + ((weight,) if has_weight else ())
    gi, gw = per_batch_shard(local, x, operands, (True, True, True) + (False,) * has_weight, (True, True))
    return gi, (jnp.sum(gw, axis=0) if has_weight else None)
