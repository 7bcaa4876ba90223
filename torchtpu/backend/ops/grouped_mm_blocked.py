"""torch._grouped_mm off TPU: grouped matmuls as a loop over row tiles (pure JAX functions).

A program compiled for TPU runs megablox's kernels (grouped_mm_tpu.py) or `jax.lax.ragged_dot`;
one compiled for any other platform (XLA:CPU, XLA:GPU) runs these (linalg.py picks with
`lax.platform_dependent`). XLA's CPU backend computes a `ragged_dot` densely: every row times every
group's matrix, masked. For one expert matmul of Qwen3's debugmodel_moe with its gradients (16,384
bfloat16 rows, 64 experts of 256 x 768: 56 MiB of operands) that is 7,264 MiB of XLA temporaries and
8.24 GiB resident, against 81 MiB and 0.75 GiB here (`python -m bench.grouped_mm_cpu`).

Here the rows, which the groups hold consecutively, are cut into tiles of `tile` rows, and a
`lax.scan` visits each (tile, group) pair that shares a row, in order: at most ceil(M / tile) +
G - 1 visits, each one (tile x K) x (K x N) product against its group's matrix, the rows of other
groups masked. Besides the result and the rows cut into tiles, no temporary is larger than one
tile's product, and the work is the rows' own plus at most one tile per group (`tile_rows` sizes
the tile to the rows per group). Rows past the last group are zero; an empty group's weight
gradient is zero. `gmm` reads weights stored (G, N, K), torchtitan's layout, and `tgmm` computes
its product in that layout, so XLA cancels the transposes PyTorch's views put around them and no
transposed copy of the experts' weights or of their gradients is made.

Every product accumulates in `acc` (float32 for 16-bit floats) and is rounded once. A row belongs
to one group, so its output is one dot over K, as in `ragged_dot`; a weight gradient sums its
group's tiles in `acc`. Both functions carry their own gradients (`jax.custom_vjp`), each one of
these functions again, so JAX's autodiff of a step that holds the experts (expert_parallel's
dispatch) keeps the same bound; PyTorch's autograd reaches the same forms through `_grouped_mm`'s
own backward formulas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["gmm", "tgmm", "tile_rows"]

MIN_TILE, MAX_TILE = 8, 128


def tile_rows(m: int, groups: int) -> int:
    """The row tile for `m` rows in `groups` groups: the largest power of two within [MIN_TILE,
    MAX_TILE] and at most half the rows per group. Where the rows per group reach 2 x MIN_TILE, the
    visits do at most 1.5x the rows' work (one tile more per group)."""
    t = MIN_TILE
    while t * 2 <= min(MAX_TILE, m // max(2 * groups, 1)):
        t *= 2
    return t


def _schedule(ends, m: int, tile: int):
    """The visits: for each of the ceil(m / tile) + G - 1 there can be, the group and the tile it
    pairs, and for each of its rows whether the row is in the group (none past the last visit).
    Group g is rows [ends[g-1], ends[g]) (ends clipped to m)."""
    groups = ends.shape[0]
    ends = jnp.clip(ends.astype(jnp.int32), 0, m)
    starts = jnp.minimum(jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends)
    first = starts // tile
    count = jnp.where(ends > starts, (ends - 1) // tile - first + 1, 0)  # tiles each group meets
    done = jnp.cumsum(count)  # visits up to each group's last
    v = jnp.arange(-(-m // tile) + groups - 1, dtype=jnp.int32)
    group = jnp.sum(done[None, :] <= v[:, None], axis=1, dtype=jnp.int32)
    real = group < groups
    group = jnp.minimum(group, groups - 1)
    tile_of = jnp.where(real, first[group] + v - (done - count)[group], 0)
    rows = tile_of[:, None] * tile + jnp.arange(tile, dtype=jnp.int32)[None, :]
    inside = real[:, None] & (rows >= starts[group][:, None]) & (rows < ends[group][:, None])
    return group, tile_of, inside


def _tiles(x, tile: int):
    """(M, ...) -> (ceil(M / tile), tile, ...), zero rows appended."""
    m = x.shape[0]
    nt = -(-m // tile)
    x = jnp.pad(x, ((0, nt * tile - m),) + ((0, 0),) * (x.ndim - 1))
    return x.reshape((nt, tile) + x.shape[1:])


def _bits(a):
    """A 16-bit float array as its uint16 bits, anything else as it is. XLA's CPU backend slices and
    updates 16-bit floats in float32, and for an array a loop slices it converts the whole array
    before the loop (a float32 copy of every expert's weights); bits it slices as they are."""
    return lax.bitcast_convert_type(a, jnp.uint16) if jnp.dtype(a.dtype).itemsize == 2 else a


def _unbits(a, dtype):
    """`_bits`' inverse for an array of `dtype`."""
    return lax.bitcast_convert_type(a, dtype) if a.dtype != dtype else a


def _gmm(x, w, ends, tile, transpose_w, precision, acc, out_dtype):
    """(M, K) x (G, K, N) -> (M, N) in `out_dtype` (`transpose_w`: w is (G, N, K), applied
    transposed), each row's product accumulated in `acc` and rounded once."""
    m = x.shape[0]
    n = w.shape[1] if transpose_w else w.shape[2]
    if m == 0 or w.shape[0] == 0:
        return jnp.zeros((m, n), out_dtype)
    group, tile_of, inside = _schedule(ends, m, tile)
    xt, wb = _bits(_tiles(x, tile)), _bits(w)
    contract = ((1,), (1,) if transpose_w else (0,))

    def visit(out, at):
        g, t, keep = at
        y = lax.dot_general(
            _unbits(xt[t], x.dtype),
            _unbits(wb[g], w.dtype),
            (contract, ((), ())),
            precision=precision,
            preferred_element_type=acc,
        )
        return out.at[t].set(jnp.where(keep[:, None], _bits(y.astype(out_dtype)), out[t])), None

    out = _bits(jnp.zeros((xt.shape[0], tile, n), out_dtype))
    out, _ = lax.scan(visit, out, (group, tile_of, inside))
    return _unbits(out, out_dtype).reshape(-1, n)[:m]


def _tgmm(x, y, ends, groups, tile, precision, acc):
    """Rows (M, K) and (M, N) -> (G, K, N) in `acc`: for each group the sum over its rows of
    x[r]^T y[r]."""
    m, k = x.shape
    n = y.shape[1]
    if m == 0 or groups == 0:
        return jnp.zeros((groups, k, n), acc)
    group, tile_of, inside = _schedule(ends, m, tile)
    xt, yt = _bits(_tiles(x, tile)), _bits(_tiles(y, tile))

    def visit(out, at):
        g, t, keep = at
        # both operands masked: a row of another group (its values, infinities included) adds nothing
        a = jnp.where(keep[:, None], _unbits(xt[t], x.dtype), 0)
        b = jnp.where(keep[:, None], _unbits(yt[t], y.dtype), 0)
        p = lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=acc)
        return out.at[g].add(p), None

    out, _ = lax.scan(visit, jnp.zeros((groups, k, n), acc), (group, tile_of, inside))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def gmm(x, w, ends, transpose_w, precision, acc, out_dtype):
    """(M, K) x (G, K, N) -> (M, N) in `out_dtype`: rows ends[g-1]:ends[g] times w[g]; rows past
    the last end are zero. `ends` int (G,), non-decreasing; `transpose_w`: w is stored (G, N, K)
    and applied transposed. `precision` and `acc` are the dot's (linalg._grouped_kw)."""
    tile = tile_rows(x.shape[0], w.shape[0])
    return _gmm(x, w, ends, tile, transpose_w, precision, acc, out_dtype)


def _gmm_fwd(x, w, ends, transpose_w, precision, acc, out_dtype):
    return gmm(x, w, ends, transpose_w, precision, acc, out_dtype), (x, w, ends)


def _gmm_bwd(transpose_w, precision, acc, out_dtype, res, g):
    x, w, ends = res
    g = g.astype(x.dtype)
    tile = tile_rows(x.shape[0], w.shape[0])
    dx = _gmm(g, w, ends, tile, not transpose_w, precision, acc, x.dtype)
    # w[e]'s gradient is the sum over its rows of x^T g, in w's layout ((G, N, K): of g^T x)
    rows = (g, x) if transpose_w else (x, g)
    dw = _tgmm(*rows, ends, w.shape[0], tile, precision, acc)
    return dx, dw.astype(w.dtype), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def tgmm(a, b, ends, precision, acc, out_dtype):
    """(K, M) x (M, N) -> (G, K, N) in `out_dtype`, G = len(ends): the g-th product over columns
    of `a` and rows of `b` ends[g-1]:ends[g] only (the experts' weight gradients); an empty group's
    product is zero. Computed as its transpose, (G, N, K): the layout of torchtitan's weights,
    into which PyTorch's backward transposes it (XLA cancels the two transposes)."""
    tile = tile_rows(b.shape[0], ends.shape[0])
    return jnp.swapaxes(_tgmm(b, a.T, ends, ends.shape[0], tile, precision, acc), 1, 2).astype(out_dtype)


def _tgmm_fwd(a, b, ends, precision, acc, out_dtype):
    return tgmm(a, b, ends, precision, acc, out_dtype), (a, b, ends)


def _tgmm_bwd(precision, acc, out_dtype, res, c):
    a, b, ends = res
    c = c.astype(jnp.result_type(a, b))
    tile = tile_rows(b.shape[0], ends.shape[0])
    # a's column r and b's row r meet c[g] of their group: da[:, r] = c[g] b[r], db[r] = a[:, r]^T c[g]
    da = _gmm(b, c, ends, tile, True, precision, acc, a.dtype).T
    db = _gmm(a.T, c, ends, tile, False, precision, acc, b.dtype)
    return da, db, None


tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)
