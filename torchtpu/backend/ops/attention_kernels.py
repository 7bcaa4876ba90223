"""torchtpu's flash-attention Pallas kernels for TPU: forward, a one-pass backward, and dK/dV and dQ.

attention_tpu.py calls them (per shard, with their declared costs); this module only builds the
three `pallas_call`s. What they add over JAX's library kernels
(`jax.experimental.pallas.ops.tpu.flash_attention`), whose block structure they share (one grid
step per (query block, key block) pair, causal pairs above the diagonal skipped):

- **Grouped-query attention without repeating keys and values.** q has H heads, k and v have
  Hkv heads (H a multiple of Hkv): the forward and dQ kernels read the key/value block of head
  h // (H / Hkv); the dK/dV kernel's grid runs over key/value heads and accumulates the
  gradients of all the query heads that share one in float32, so k, v are never broadcast to H
  heads and dk, dv never summed over the repeats outside the kernel.
- **One pass for the backward** (`backward`): per (batch, key/value head) the grid runs over the
  group's query heads, then key blocks, then query blocks, and computes each visited block pair's
  scores and their gradient once for dV, dK and dQ (five block matmuls, against seven in the
  dK/dV and dQ kernels, which compute them each), accumulating dQ of the whole query head and
  dK, dV of the whole key/value head in float32 in VMEM (`backward_vmem_bytes`).
- **Softmax statistics as rows.** The forward writes the log-sum-exp (B, H, 1, L) directly,
  and the backward kernels read it and `di` (rowsum(dO * O)) in that layout, instead of f32
  (B, H, L, 128) arrays broadcast across lanes in HBM. The dK/dV kernel computes the
  transposed scores (key rows, query columns), where a per-query statistic is a row that
  broadcasts across sublanes; the dQ kernel turns the two rows into lane-broadcast columns once
  per query block, in VMEM.

Arguments are (B, H, L, D) queries and (B, Hkv, S, D) keys/values with one head dim D (64, 128
or 256: attention_tpu pads other sizes), L and S multiples of the block sizes, an optional
float32 additive bias (B, H, L, S) added to q.k before the softmax scale, as the library's
kernels take it. Masked entries get `mask_value` (finite, so exp() stays defined).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["forward", "backward", "backward_dkv", "backward_dq", "backward_vmem_bytes", "KERNEL_NAMES"]

_LANES = 128
_NT = (((1,), (1,)), ((), ()))  # a @ b.T: contract both operands' last dims
KERNEL_NAMES = {
    "forward": "torchtpu_flash_fwd",
    "backward": "torchtpu_flash_bwd_onepass",
    "dkv": "torchtpu_flash_bwd_dkv",
    "dq": "torchtpu_flash_bwd_dq",
}


def _runs(q_block, bq, k_block, bk, causal):
    """Whether a (query block, key block) pair has any entry on or below the diagonal."""
    if not causal:
        return True
    return (q_block + 1) * bq - 1 >= k_block * bk


def _first_q_block(k_block, bk, bq):
    """The first query block that sees key block `k_block` under a causal mask."""
    return lax.div(k_block * bk, bq)


def _last_k_block(q_block, bq, bk):
    """The last key block query block `q_block` sees under a causal mask."""
    return lax.div((q_block + 1) * bq - 1, bk)


def _causal_keep(shape, q_start, k_start, q_axis):
    """Boolean (shape) of the entries with key position <= query position; queries along
    `q_axis` of the tile, keys along the other."""
    q_pos = lax.broadcasted_iota(jnp.int32, shape, q_axis) + q_start
    k_pos = lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis) + k_start
    return k_pos <= q_pos


def _widen(col, n):
    """A (rows, 128) lane-broadcast column, as (rows, n)."""
    if n == _LANES:
        return col
    if n < _LANES:
        return col[:, :n]
    return jnp.tile(col, (1, n // _LANES))


def _params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _specs(*pairs):
    return [None if shape is None else pl.BlockSpec(shape, index) for shape, index in pairs]


# ----------------------------------------------------------------------------- forward
# Grid indices are non-negative int32 scalars: their divisions are lax.div / lax.rem (jnp's
# floor division adds sign corrections Mosaic does not lower without a TPU attached).


def _forward_kernel(
    q_ref, k_ref, v_ref, bias_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, *, causal, scale, mask_value, nk
):
    qi, ki = pl.program_id(2), pl.program_id(3)
    bq, d = q_ref.shape[2], q_ref.shape[3]
    bk = k_ref.shape[2]

    @pl.when(ki == 0)
    def _():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(_runs(qi, bq, ki, bk, causal))
    def _():
        q, k, v = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]
        s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)  # (bq, bk)
        if bias_ref is not None:
            s = s + bias_ref[0, 0].astype(jnp.float32)
        s = s * scale
        if causal:
            s = s + jnp.where(_causal_keep(s.shape, qi * bq, ki * bk, 0), 0.0, mask_value)
        m_prev, l_prev = m_scr[...], l_scr[...]  # (bq, 128), equal across lanes
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - _widen(m_next, bk))
        alpha = jnp.exp(m_prev - m_next)
        l_scr[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        m_scr[...] = m_next
        pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_scr[...] = acc_scr[...] * _widen(alpha, d) + pv

    @pl.when(ki == nk - 1)
    def _():
        l_col = l_scr[...]
        o_ref[0, 0] = (acc_scr[...] / _widen(l_col, d)).astype(o_ref.dtype)
        lse_col = m_scr[...] + jnp.log(l_col)  # (bq, 128)
        lse_ref[0, 0] = lse_col.T[:1, :]  # (1, bq)


def _query_major(q, k, bias, causal, block_q, block_k):
    """The grid (B, H, query blocks, key blocks) of the forward and dQ kernels and their block
    specs: q-shaped blocks, key/value blocks of each query head's group, the bias, and the (1, bq)
    statistic rows."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep, nq, nk = H // Hkv, L // block_q, S // block_k

    def kv_block(qi, ki):
        # a skipped pair (past the diagonal) points at the last key block its query block needs,
        # which the step before fetched: skipped steps fetch nothing new
        return jnp.minimum(ki, _last_k_block(qi, block_q, block_k)) if causal else ki

    q_spec = ((1, 1, block_q, D), lambda b, h, qi, ki: (b, h, qi, 0))
    kv_spec = ((1, 1, block_k, D), lambda b, h, qi, ki: (b, lax.div(h, rep), kv_block(qi, ki), 0))
    row_spec = ((1, 1, 1, block_q), lambda b, h, qi, ki: (b, h, 0, qi))
    bias_spec = (
        (None, None) if bias is None else ((1, 1, block_q, block_k), lambda b, h, qi, ki: (b, h, qi, kv_block(qi, ki)))
    )
    return (B, H, nq, nk), q_spec, kv_spec, bias_spec, row_spec


def forward(q, k, v, bias, *, causal: bool, scale: float, mask_value: float, block_q: int, block_k: int):
    """(out (B, H, L, D) in q's dtype, lse (B, H, 1, L) float32)."""
    grid, q_spec, kv_spec, bias_spec, row_spec = _query_major(q, k, bias, causal, block_q, block_k)
    B, H, L, D = q.shape
    nk = grid[3]
    kernel = functools.partial(_forward_kernel, causal=causal, scale=scale, mask_value=mask_value, nk=nk)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=grid,
            in_specs=_specs(q_spec, kv_spec, kv_spec, bias_spec),
            out_specs=_specs(q_spec, row_spec),
            scratch_shapes=[
                pltpu.VMEM((block_q, _LANES), jnp.float32),
                pltpu.VMEM((block_q, _LANES), jnp.float32),
                pltpu.VMEM((block_q, D), jnp.float32),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, 1, L), jnp.float32)],
        compiler_params=_params(("parallel", "parallel", "parallel", "arbitrary")),
        name=KERNEL_NAMES["forward"],
    )(q, k, v, bias)


# ----------------------------------------------------------------------------- dK / dV


def _transposed_grads(q_ref, k_ref, v_ref, do_ref, bias_ref, lse_ref, di_ref, qi, ki, causal, scale, mask_value):
    """The softmax of a (query block, key block) pair and its scores' gradient, both transposed
    (key rows, query columns), float32, from the rows of lse and di: what the dK/dV kernel and the
    one-pass backward accumulate from."""
    q, k, v, do = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0]
    bq, bk = q.shape[0], k.shape[0]
    st = lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32)  # (bk, bq): scores, transposed
    if bias_ref is not None:
        st = st + bias_ref[0, 0].astype(jnp.float32).T
    st = st * scale
    if causal:
        st = st + jnp.where(_causal_keep(st.shape, qi * bq, ki * bk, 1), 0.0, mask_value)
    pt = jnp.exp(st - lse_ref[0, 0])  # the softmax (transposed); lse (1, bq) broadcasts over keys
    dpt = lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)  # (bk, bq)
    return pt, pt * (dpt - di_ref[0, 0]) * scale


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    bias_ref,
    lse_ref,
    do_ref,
    di_ref,
    dk_ref,
    dv_ref,
    dk_scr,
    dv_scr,
    *,
    causal,
    scale,
    mask_value,
    nq,
    steps,
):
    ki, j = pl.program_id(2), pl.program_id(3)
    qi = lax.rem(j, nq)  # j runs over (query head of the group, query block)
    bq, bk = q_ref.shape[2], k_ref.shape[2]

    @pl.when(j == 0)
    def _():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(_runs(qi, bq, ki, bk, causal))
    def _():
        q, do = q_ref[0, 0], do_ref[0, 0]
        pt, dst = _transposed_grads(
            q_ref, k_ref, v_ref, do_ref, bias_ref, lse_ref, di_ref, qi, ki, causal, scale, mask_value
        )
        dv_scr[...] += lax.dot(pt.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dk_scr[...] += lax.dot(dst.astype(q.dtype), q, preferred_element_type=jnp.float32)

    @pl.when(j == steps - 1)
    def _():
        dk_ref[0, 0] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[0, 0] = dv_scr[...].astype(dv_ref.dtype)


def backward_dkv(q, k, v, bias, lse, do, di, *, causal, scale, mask_value, block_q, block_k):
    """(dk, dv) of k's shape (B, Hkv, S, D) and dtype, the gradients of all query heads that
    share a key/value head summed in float32. lse, di: (B, H, 1, L) float32."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep, nq, nk = H // Hkv, L // block_q, S // block_k

    def q_at(b, g, ki, j):
        r, qi = lax.div(j, nq), lax.rem(j, nq)
        if causal:  # skipped pairs point at the first query block this key block needs
            qi = jnp.maximum(qi, _first_q_block(ki, block_k, block_q))
        return b, g * rep + r, qi

    def q_index(b, g, ki, j):
        b, h, qi = q_at(b, g, ki, j)
        return b, h, qi, 0

    def row_index(b, g, ki, j):
        b, h, qi = q_at(b, g, ki, j)
        return b, h, 0, qi

    def bias_index(b, g, ki, j):
        b, h, qi = q_at(b, g, ki, j)
        return b, h, qi, ki

    q_spec = ((1, 1, block_q, D), q_index)
    kv_spec = ((1, 1, block_k, D), lambda b, g, ki, j: (b, g, ki, 0))
    row_spec = ((1, 1, 1, block_q), row_index)
    bias_spec = (None, None) if bias is None else ((1, 1, block_q, block_k), bias_index)
    steps = rep * nq
    kernel = functools.partial(_dkv_kernel, causal=causal, scale=scale, mask_value=mask_value, nq=nq, steps=steps)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(B, Hkv, nk, steps),
            in_specs=_specs(q_spec, kv_spec, kv_spec, bias_spec, row_spec, q_spec, row_spec),
            out_specs=_specs(kv_spec, kv_spec),
            scratch_shapes=[pltpu.VMEM((block_k, D), jnp.float32), pltpu.VMEM((block_k, D), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(("parallel", "parallel", "parallel", "arbitrary")),
        name=KERNEL_NAMES["dkv"],
    )(q, k, v, bias, lse, do, di)


# ----------------------------------------------------------------------------- dQ


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    bias_ref,
    lse_ref,
    do_ref,
    di_ref,
    dq_ref,
    dq_scr,
    lse_scr,
    di_scr,
    *,
    causal,
    scale,
    mask_value,
    nk,
):
    qi, ki = pl.program_id(2), pl.program_id(3)
    bq, bk = q_ref.shape[2], k_ref.shape[2]

    @pl.when(ki == 0)
    def _():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
        # the rows (1, bq) as lane-broadcast columns (bq, 128), once per query block
        lse_scr[...] = jnp.broadcast_to(lse_ref[0, 0], (_LANES, bq)).T
        di_scr[...] = jnp.broadcast_to(di_ref[0, 0], (_LANES, bq)).T

    @pl.when(_runs(qi, bq, ki, bk, causal))
    def _():
        q, k, v, do = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0]
        s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)  # (bq, bk)
        if bias_ref is not None:
            s = s + bias_ref[0, 0].astype(jnp.float32)
        s = s * scale
        if causal:
            s = s + jnp.where(_causal_keep(s.shape, qi * bq, ki * bk, 0), 0.0, mask_value)
        p = jnp.exp(s - _widen(lse_scr[...], bk))
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = p * (dp - _widen(di_scr[...], bk)) * scale
        dq_scr[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    @pl.when(ki == nk - 1)
    def _():
        dq_ref[0, 0] = dq_scr[...].astype(dq_ref.dtype)


def backward_dq(q, k, v, bias, lse, do, di, *, causal, scale, mask_value, block_q, block_k):
    """dq of q's shape and dtype. lse, di: (B, H, 1, L) float32."""
    grid, q_spec, kv_spec, bias_spec, row_spec = _query_major(q, k, bias, causal, block_q, block_k)
    D, nk = q.shape[3], grid[3]
    kernel = functools.partial(_dq_kernel, causal=causal, scale=scale, mask_value=mask_value, nk=nk)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=grid,
            in_specs=_specs(q_spec, kv_spec, kv_spec, bias_spec, row_spec, q_spec, row_spec),
            out_specs=_specs(q_spec),
            scratch_shapes=[
                pltpu.VMEM((block_q, D), jnp.float32),
                pltpu.VMEM((block_q, _LANES), jnp.float32),
                pltpu.VMEM((block_q, _LANES), jnp.float32),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        compiler_params=_params(("parallel", "parallel", "parallel", "arbitrary")),
        name=KERNEL_NAMES["dq"],
    )(q, k, v, bias, lse, do, di)[0]


# ----------------------------------------------------------------------------- dQ, dK and dV in one pass


def _backward_kernel(
    q_ref,
    k_ref,
    v_ref,
    bias_ref,
    lse_ref,
    do_ref,
    di_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dq_scr,
    dk_scr,
    dv_scr,
    *,
    causal,
    scale,
    mask_value,
    rep,
    nk,
    nq,
):
    r, ki, qi = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    bq, bk = q_ref.shape[2], k_ref.shape[2]

    @pl.when((r == 0) & (ki == 0) & (qi == 0))
    def _():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when((ki == 0) & (qi == 0))
    def _():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when(_runs(qi, bq, ki, bk, causal))
    def _():
        q, k, do = q_ref[0, 0], k_ref[0, 0], do_ref[0, 0]
        pt, dst = _transposed_grads(
            q_ref, k_ref, v_ref, do_ref, bias_ref, lse_ref, di_ref, qi, ki, causal, scale, mask_value
        )
        rows_k = pl.ds(pl.multiple_of(ki * bk, bk), bk)
        dv_scr[rows_k, :] += lax.dot(pt.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dst = dst.astype(q.dtype)
        dk_scr[rows_k, :] += lax.dot(dst, q, preferred_element_type=jnp.float32)
        rows_q = pl.ds(pl.multiple_of(qi * bq, bq), bq)
        dq_scr[rows_q, :] += lax.dot(dst.T, k, preferred_element_type=jnp.float32)

    @pl.when((ki == nk - 1) & (qi == nq - 1))
    def _():
        dq_ref[0, 0] = dq_scr[...].astype(dq_ref.dtype)

    @pl.when((r == rep - 1) & (ki == nk - 1) & (qi == nq - 1))
    def _():
        dk_ref[0, 0] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[0, 0] = dv_scr[...].astype(dv_ref.dtype)


def backward_vmem_bytes(L: int, S: int, D: int, itemsize: int, block_q: int, block_k: int, with_bias: bool) -> int:
    """VMEM the one-pass backward takes: its float32 accumulators of a whole query head's dQ and
    a whole key/value head's dK and dV, its output blocks (those three, double-buffered), its
    input blocks (double-buffered) and its (block_k, block_q) float32 intermediates."""
    acc = (L + 2 * S) * D * 4
    outs = 2 * (L + 2 * S) * D * itemsize
    ins = 2 * (2 * block_q * D + 2 * block_k * D) * itemsize + 2 * 2 * block_q * 4
    ins += 2 * block_q * block_k * 4 if with_bias else 0
    return acc + outs + ins + 5 * block_q * block_k * 4


def backward(q, k, v, bias, lse, do, di, *, causal, scale, mask_value, block_q, block_k, vmem_limit_bytes):
    """(dq, dk, dv) of q's and k's shapes and dtypes in one pass over the (query block, key
    block) pairs: the scores and their gradient are computed once for all three (the two-kernel
    backward computes them in each). The grid runs, per batch and key/value head, over the
    group's query heads, then key blocks, then query blocks; dK and dV of the whole key/value
    head and dQ of the whole query head accumulate in float32 in VMEM (`backward_vmem_bytes`).
    lse, di: (B, H, 1, L) float32."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep, nq, nk = H // Hkv, L // block_q, S // block_k

    def q_block(ki, qi):
        # skipped pairs (above the diagonal) point at the first query block this key block
        # needs, which the next step that runs fetches anyway
        return jnp.maximum(qi, _first_q_block(ki, block_k, block_q)) if causal else qi

    q_spec = ((1, 1, block_q, D), lambda b, g, r, ki, qi: (b, g * rep + r, q_block(ki, qi), 0))
    kv_spec = ((1, 1, block_k, D), lambda b, g, r, ki, qi: (b, g, ki, 0))
    row_spec = ((1, 1, 1, block_q), lambda b, g, r, ki, qi: (b, g * rep + r, 0, q_block(ki, qi)))
    bias_spec = (
        (None, None)
        if bias is None
        else ((1, 1, block_q, block_k), lambda b, g, r, ki, qi: (b, g * rep + r, q_block(ki, qi), ki))
    )
    dq_spec = ((1, 1, L, D), lambda b, g, r, ki, qi: (b, g * rep + r, 0, 0))
    dkv_spec = ((1, 1, S, D), lambda b, g, r, ki, qi: (b, g, 0, 0))
    kernel = functools.partial(
        _backward_kernel, causal=causal, scale=scale, mask_value=mask_value, rep=rep, nk=nk, nq=nq
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(B, Hkv, rep, nk, nq),
            in_specs=_specs(q_spec, kv_spec, kv_spec, bias_spec, row_spec, q_spec, row_spec),
            out_specs=_specs(dq_spec, dkv_spec, dkv_spec),
            scratch_shapes=[
                pltpu.VMEM((L, D), jnp.float32),
                pltpu.VMEM((S, D), jnp.float32),
                pltpu.VMEM((S, D), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        name=KERNEL_NAMES["backward"],
    )(q, k, v, bias, lse, do, di)
