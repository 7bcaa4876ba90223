"""FlexAttention's math as pure JAX functions: scores, score_mod, block mask, softmax, and its gradient.

`torch.nn.attention.flex_attention` on tpu reaches these through backend/flex_attention.py, which
turns the user's `score_mod` and `mask_mod` (Python functions of torch scalars) into JAX functions
of 0-d arrays and hands them over here with the block mask's arrays. Here those functions are
vectorised over the (batch, head, query, key) grid with `jax.vmap`, one axis at a time, which is
what PyTorch's own math path does with `torch.vmap`: a mod sees scalars, so indexing a captured
tensor with `q_idx` or a reduction inside it means what it means in PyTorch.

The attention, for q (B, Hq, L, E), k (Bkv, Hkv, S, E), v (Bkv, Hkv, S, Ev), Hq a multiple of
Hkv (query head h reads key/value head h // (Hq / Hkv)) and Bkv either B or 1:

    s = (q @ k^T) * scale                       in float32 (float64 for float64 inputs)
    s' = score_mod(s, b, h, q_idx, kv_idx)      where the position is kept, else -inf
    lse = logsumexp(s'), out = softmax(s') @ v  a row with no kept key: lse -inf, out 0

A position is kept when its (query block, key block) is one of the block mask's full blocks, or
one of its partial blocks and `mask_mod(b, h, q_idx, kv_idx)` is true; a block in neither list is
masked whatever `mask_mod` says. This is how PyTorch's kernels read a BlockMask; its CPU math
path applies `mask_mod` everywhere, which gives the same result for any mask built by
`create_block_mask`.

Long query sequences run in blocks of `Q_BLOCK` rows (`lax.map` forward, `lax.scan` backward),
so no (L, S) score matrix is whole at once. The backward recomputes each block's scores,
differentiates `score_mod` with `jax.vjp` (giving the gradients of the floating-point tensors it
captured too) and sums key/value gradients over the query heads that share them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Blocks", "forward", "backward", "Q_BLOCK"]

Q_BLOCK = 512  # query rows per block when L is a larger multiple of it


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A BlockMask's arrays: `kv_num` (Bm, Hm, nq) and `kv_idx` (Bm, Hm, nq, J) list each query
    block's partial key blocks, `full_num`/`full_idx` its full ones (None: no full blocks);
    Bm and Hm are 1 or the batch and query heads."""

    kv_num: jax.Array
    kv_idx: jax.Array
    full_num: jax.Array | None
    full_idx: jax.Array | None
    q_block: int
    kv_block: int


def _acc(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


_LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _dot(eq, a, b, dtype):
    """einsum of a and b for inputs of `dtype`: bfloat16/float16 operands (both rounded to it, as
    PyTorch's math path rounds the probabilities and score gradients to the query's dtype) with
    float32 accumulation, which the MXU does natively; wider inputs in full precision."""
    if jnp.dtype(dtype) in _LOW:
        return jnp.einsum(eq, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)
    acc = _acc(dtype)
    return jnp.einsum(eq, a.astype(acc), b.astype(acc), precision=lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------- the grid


def _grid(fn, score, B, H, rows, S, start, bufs):
    """`fn(score?, b, h, q_idx, kv_idx, *bufs)` over the (B, H, rows, S) grid whose query indices
    start at `start`; `score` is None for a mask_mod, else (B, H, rows, S)."""
    idx = (
        jnp.arange(B, dtype=jnp.int32),
        jnp.arange(H, dtype=jnp.int32),
        start + jnp.arange(rows, dtype=jnp.int32),
        jnp.arange(S, dtype=jnp.int32),
    )
    lead = () if score is None else (score,)
    n_lead, n_bufs = len(lead), len(bufs)
    f = fn
    for axis in (3, 2, 1, 0):  # innermost vmap over kv_idx, outermost over the batch
        axes = (0,) * n_lead + tuple(0 if i == axis else None for i in range(4)) + (None,) * n_bufs
        f = jax.vmap(f, in_axes=axes)
    return f(*lead, *idx, *bufs)


def _dense_blocks(num, idx, n_blocks):
    """(Bm, Hm, nq, n_blocks) booleans: which key blocks the index lists name."""
    listed = jnp.arange(idx.shape[-1]) < num[..., None]
    hits = (idx[..., None] == jnp.arange(n_blocks, dtype=idx.dtype)) & listed[..., None]
    return jnp.any(hits, axis=-2)


def _expand(blocks_map, blocks: Blocks, start, rows, S):
    """A block map (Bm, Hm, nq, nk) read at each (query, key) position of the rows."""
    qb = (start + jnp.arange(rows)) // blocks.q_block
    kb = jnp.arange(S) // blocks.kv_block
    return blocks_map[:, :, qb][:, :, :, kb]


def _kept(blocks: Blocks, mask_fn, mask_bufs, B, H, start, rows, S):
    n_kv = -(-S // blocks.kv_block)
    partial = _expand(_dense_blocks(blocks.kv_num, blocks.kv_idx, n_kv), blocks, start, rows, S)
    kept = partial
    if mask_fn is not None:
        kept = partial & _grid(mask_fn, None, B, H, rows, S, start, mask_bufs).astype(jnp.bool_)
    if blocks.full_num is not None:
        kept = kept | _expand(_dense_blocks(blocks.full_num, blocks.full_idx, n_kv), blocks, start, rows, S)
    return jnp.broadcast_to(kept, (B, H, rows, S))


# ----------------------------------------------------------------------------- shapes


def _grouped(q, k, v):
    """k, v broadcast to q's batch; q viewed as (B, Hkv, G, L, E)."""
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    k = jnp.broadcast_to(k, (B,) + k.shape[1:])
    v = jnp.broadcast_to(v, (B,) + v.shape[1:])
    return q.reshape(B, Hkv, Hq // Hkv, L, E), k, v


def _scores(qg, k, scale, acc):
    s = _dot("bkgle,bkse->bkgls", qg, k, qg.dtype)
    B, Hkv, G, L, S = s.shape
    return (s * jnp.asarray(scale, acc)).reshape(B, Hkv * G, L, S)


def _row_blocks(L):
    if L <= Q_BLOCK or L % Q_BLOCK:
        return 1, L
    return L // Q_BLOCK, Q_BLOCK


def _rows_of(x, start, size, axis=2):
    if x.shape[axis] == size:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


# ----------------------------------------------------------------------------- forward


def _block_forward(qg, k, v, start, blocks, score_fn, mask_fn, score_bufs, mask_bufs, scale):
    acc = _acc(qg.dtype)
    B, Hkv, G, rows, _ = qg.shape
    H, S = Hkv * G, k.shape[2]
    s = _scores(qg, k, scale, acc)
    if score_fn is not None:
        s = _grid(score_fn, s, B, H, rows, S, start, score_bufs).astype(acc)
    kept = _kept(blocks, mask_fn, mask_bufs, B, H, start, rows, S)
    s = jnp.where(kept, s, jnp.asarray(-jnp.inf, acc))
    top = jnp.max(s, axis=-1)
    shift = jnp.where(jnp.isfinite(top), top, 0)
    e = jnp.exp(s - shift[..., None])
    total = jnp.sum(e, axis=-1)
    lse = jnp.log(total) + shift  # -inf for a row with no kept key
    p = e / jnp.where(total > 0, total, 1)[..., None]
    pg = p.reshape(B, Hkv, G, rows, S)
    out = _dot("bkgls,bksd->bkgld", pg, v, qg.dtype)
    return out.reshape(B, H, rows, -1), lse, top


def forward(
    q,
    k,
    v,
    blocks: Blocks,
    score_fn: Callable | None,
    mask_fn: Callable | None,
    score_bufs=(),
    mask_bufs=(),
    *,
    scale: float,
):
    """(out (B, Hq, L, Ev) in q's dtype, lse (B, Hq, L), max score (B, Hq, L)), both natural-log
    statistics in float32 (float64 for float64 inputs); None for `score_fn` or `mask_fn` means the
    identity score and a mask that keeps every position of the listed blocks."""
    qg, k, v = _grouped(q, k, v)
    L = q.shape[2]
    n, size = _row_blocks(L)
    args = (blocks, score_fn, mask_fn, tuple(score_bufs), tuple(mask_bufs), scale)
    if n == 1:
        out, lse, top = _block_forward(qg, k, v, 0, *args)
    else:

        def one(i):
            start = i * size
            return _block_forward(_rows_of(qg, start, size, axis=3), k, v, start, *args)

        outs, lses, tops = lax.map(one, jnp.arange(n))
        out = jnp.moveaxis(outs, 0, 2).reshape(q.shape[:3] + (v.shape[-1],))
        lse = jnp.moveaxis(lses, 0, 2).reshape(q.shape[:3])
        top = jnp.moveaxis(tops, 0, 2).reshape(q.shape[:3])
    return out.astype(q.dtype), lse, top


# ----------------------------------------------------------------------------- backward


def _floating(bufs):
    return [i for i, b in enumerate(bufs) if jnp.issubdtype(b.dtype, jnp.inexact)]


def _block_backward(qg, k, v, out, g, lse, dlse, start, blocks, score_fn, mask_fn, score_bufs, mask_bufs, scale):
    acc = _acc(qg.dtype)
    B, Hkv, G, rows, E = qg.shape
    H, S = Hkv * G, k.shape[2]
    diff = _floating(score_bufs)

    def modded(s, *floats):
        if score_fn is None:
            return s
        bufs = list(score_bufs)
        for i, f in zip(diff, floats):
            bufs[i] = f
        return _grid(score_fn, s, B, H, rows, S, start, tuple(bufs)).astype(acc)

    s = _scores(qg, k, scale, acc)
    s2, vjp = jax.vjp(modded, s, *(score_bufs[i] for i in diff))
    kept = _kept(blocks, mask_fn, mask_bufs, B, H, start, rows, S)
    alive = jnp.isfinite(lse)
    keep = kept & alive[..., None]
    p = jnp.where(keep, jnp.exp(jnp.where(keep, s2, 0) - jnp.where(alive, lse, 0)[..., None]), 0)
    g = jnp.where(alive[..., None], g.astype(acc), 0)
    pg = p.reshape(B, Hkv, G, rows, S)
    gg = g.reshape(B, Hkv, G, rows, -1)
    dv = _dot("bkgls,bkgld->bksd", pg, gg, qg.dtype)
    dp = _dot("bkgld,bksd->bkgls", gg, v, qg.dtype).reshape(B, H, rows, S)
    delta = jnp.sum(out.astype(acc) * g, axis=-1)
    ds = p * (dp - delta[..., None] + jnp.where(alive, dlse, 0)[..., None])
    ds, *dbufs = vjp(ds)
    ds = (ds * jnp.asarray(scale, acc)).reshape(B, Hkv, G, rows, S)
    dq = _dot("bkgls,bkse->bkgle", ds, k, qg.dtype)
    dk = _dot("bkgls,bkgle->bkse", ds, qg, qg.dtype)
    return dq, dk, dv, tuple(dbufs)


def backward(
    q,
    k,
    v,
    out,
    lse,
    grad_out,
    grad_lse,
    blocks: Blocks,
    score_fn: Callable | None,
    mask_fn: Callable | None,
    score_bufs=(),
    mask_bufs=(),
    *,
    scale: float,
):
    """Gradients (dq, dk, dv, dbufs) of `forward` from its output and natural-log lse, given the
    output's gradient and the lse's (either may be None: zero). `dbufs` has one entry per entry
    of `score_bufs`: the gradient of a floating-point buffer, None for the others."""
    B, Hq, L, E = q.shape
    acc = _acc(q.dtype)
    Bkv = k.shape[0]
    qg, kb, vb = _grouped(q, k, v)
    g = jnp.zeros(out.shape, acc) if grad_out is None else grad_out
    dlse = jnp.zeros(lse.shape, acc) if grad_lse is None else grad_lse.astype(acc)
    lse = lse.astype(acc)
    score_bufs, mask_bufs = tuple(score_bufs), tuple(mask_bufs)
    diff = _floating(score_bufs)
    args = (blocks, score_fn, mask_fn, score_bufs, mask_bufs, scale)
    n, size = _row_blocks(L)
    if n == 1:
        dqg, dk, dv, dbufs = _block_backward(qg, kb, vb, out, g, lse, dlse, 0, *args)
        dq = dqg.reshape(q.shape)
    else:

        def step(carry, i):
            start = i * size
            dqb, dkb, dvb, dbb = _block_backward(
                _rows_of(qg, start, size, axis=3),
                kb,
                vb,
                _rows_of(out, start, size),
                _rows_of(g, start, size),
                _rows_of(lse, start, size),
                _rows_of(dlse, start, size),
                start,
                *args,
            )
            dk_acc, dv_acc, db_acc = carry
            return (dk_acc + dkb, dv_acc + dvb, tuple(a + b for a, b in zip(db_acc, dbb))), dqb

        zeros = (
            jnp.zeros(kb.shape, acc),
            jnp.zeros(vb.shape[:3] + (v.shape[-1],), acc),
            tuple(jnp.zeros(score_bufs[i].shape, score_bufs[i].dtype) for i in diff),
        )
        (dk, dv, dbufs), dqs = lax.scan(step, zeros, jnp.arange(n))
        # (n, B, Hkv, G, size, E) per block -> (B, Hq, L, E)
        dq = jnp.moveaxis(dqs, 0, 3).reshape(q.shape)
    if Bkv == 1 and B > 1:  # keys and values broadcast over the batch
        dk, dv = dk.sum(0, keepdims=True), dv.sum(0, keepdims=True)
    grads = [None] * len(score_bufs)
    for i, d in zip(diff, dbufs):
        grads[i] = d.astype(score_bufs[i].dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), tuple(grads)
