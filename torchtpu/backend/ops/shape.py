"""Shape-building ops: concatenation, flips and rolls, triangles, repeats, padding, the
*_scatter ops that write a view's values into a copy of its base, diagonals, and the prims
shape ops that PyTorch's decompositions emit.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..registry import aten, lower

prims = __import__("torch").ops.prims


def _dim(d, ndim):
    return d + ndim if d < 0 else d


def _result_dtype(arrays):
    return jnp.result_type(*arrays) if arrays else jnp.float32


# ----------------------------------------------------------------------------- cat / stack


@lower(aten.cat.default, prims.cat.default)
def cat(tensors, dim=0):
    tensors = list(tensors)
    dtype = _result_dtype(tensors)
    # PyTorch skips legacy 1-D empty tensors whatever the other shapes are
    keep = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not keep:
        return jnp.zeros((0,), dtype)
    d = _dim(dim, keep[0].ndim)
    return jnp.concatenate([t.astype(dtype) for t in keep], axis=d)


@lower(aten.stack.default)
def stack(tensors, dim=0):
    tensors = list(tensors)
    dtype = _result_dtype(tensors)
    return jnp.stack([t.astype(dtype) for t in tensors], axis=_dim(dim, tensors[0].ndim + 1))


def _atleast(t, n):
    return t.reshape((1,) * (n - t.ndim) + t.shape) if t.ndim < n else t


@lower(aten.hstack.default)
def hstack(tensors):
    tensors = [_atleast(t, 1) for t in tensors]
    return cat(tensors, 0 if tensors[0].ndim == 1 else 1)


@lower(aten.vstack.default)
def vstack(tensors):
    return cat([_atleast(t, 2) for t in tensors], 0)


@lower(aten.dstack.default)
def dstack(tensors):
    out = []
    for t in tensors:
        if t.ndim == 0:
            t = t.reshape(1, 1, 1)
        elif t.ndim == 1:
            t = t.reshape(1, -1, 1)
        elif t.ndim == 2:
            t = t[..., None]
        out.append(t)
    return cat(out, 2)


@lower(aten.column_stack.default)
def column_stack(tensors):
    out = [t.reshape(-1, 1) if t.ndim <= 1 else t for t in tensors]
    return cat(out, 1)


@lower(aten._chunk_cat.default)
def _chunk_cat(tensors, dim, num_chunks):
    tensors = list(tensors)
    dtype = _result_dtype(tensors)
    d = _dim(dim, tensors[0].ndim)
    parts = []
    for t in tensors:
        n = t.shape[d]
        chunk = -(-n // num_chunks)
        pad = chunk * num_chunks - n
        if pad:
            widths = [(0, 0)] * t.ndim
            widths[d] = (0, pad)
            t = jnp.pad(t, widths)
        parts.append(t.astype(dtype).reshape(t.shape[:d] + (num_chunks, -1)))
    return jnp.concatenate(parts, axis=d + 1)


# ----------------------------------------------------------------------------- flips, rolls, triangles


@lower(aten.flip.default, prims.rev.default)
def flip(self, dims):
    if self.ndim == 0 or not dims:
        return self
    return jnp.flip(self, axis=tuple(_dim(d, self.ndim) for d in dims))


@lower(aten.fliplr.default)
def fliplr(self):
    return jnp.flip(self, 1)


@lower(aten.flipud.default)
def flipud(self):
    return jnp.flip(self, 0)


@lower(aten.roll.default)
def roll(self, shifts, dims=()):
    shifts = list(shifts) if not isinstance(shifts, int) else [shifts]
    dims = list(dims) if not isinstance(dims, int) else [dims]
    if self.size == 0:
        return self
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), tuple(_dim(d, self.ndim) for d in dims))


@lower(aten.rot90.default)
def rot90(self, k=1, dims=(0, 1)):
    dims = tuple(_dim(d, self.ndim) for d in dims)
    return jnp.rot90(self, k, axes=dims)


def _tri_mask(shape, diagonal, lower_):
    rows, cols = shape[-2], shape[-1]
    i = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    j = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return (j - i <= diagonal) if lower_ else (j - i >= diagonal)


@lower(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.where(_tri_mask(self.shape, diagonal, True), self, jnp.zeros((), self.dtype))


@lower(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.where(_tri_mask(self.shape, diagonal, False), self, jnp.zeros((), self.dtype))


# ----------------------------------------------------------------------------- repeats


@lower(aten.repeat.default)
def repeat(self, repeats):
    repeats = tuple(repeats)
    x = self.reshape((1,) * (len(repeats) - self.ndim) + self.shape)
    return jnp.tile(x, repeats)


@lower(aten.tile.default)
def tile(self, dims):
    dims = tuple(dims)
    if len(dims) < self.ndim:
        dims = (1,) * (self.ndim - len(dims)) + dims
    return repeat(self, dims)


@lower(aten.repeat_interleave.self_int)
def repeat_interleave_int(self, repeats, dim=None, output_size=None):
    if dim is None:
        return jnp.repeat(self.reshape(-1), repeats)
    return jnp.repeat(self, repeats, axis=_dim(dim, self.ndim))


# ----------------------------------------------------------------------------- padding


@lower(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    pad = list(pad)
    cfg = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        cfg[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value).astype(self.dtype), cfg)


def _pad_indices(n, lo, hi, mode):
    i = np.arange(-lo, n + hi)
    if mode == "replicate":
        return np.clip(i, 0, n - 1)
    if mode == "reflect":
        i = np.abs(i)
        return np.where(i > n - 1, 2 * (n - 1) - i, i)
    return np.mod(i, n)  # circular


def _pad_gather(self, padding, mode):
    padding = list(padding)
    k = len(padding) // 2
    out = self
    for i in range(k):
        d = self.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        idx = _pad_indices(self.shape[d], lo, hi, mode)
        out = jnp.take(out, jnp.asarray(idx), axis=d)
    return out


def _pad_scatter(grad_output, self, padding, mode):
    padding = list(padding)
    k = len(padding) // 2
    compute = jnp.float32 if grad_output.dtype in (jnp.bfloat16, jnp.float16) else grad_output.dtype
    g = grad_output.astype(compute)
    for i in reversed(range(k)):
        d = self.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        n = self.shape[d]
        idx = jnp.asarray(_pad_indices(n, lo, hi, mode))
        shape = list(g.shape)
        shape[d] = n
        g = jnp.zeros(shape, compute).at[(slice(None),) * d + (idx,)].add(g)
    return g.astype(grad_output.dtype)


def _register_pads():
    for mode, name in (("reflect", "reflection"), ("replicate", "replication")):
        for n in (1, 2, 3):
            fwd = getattr(aten, f"{name}_pad{n}d").default
            bwd = getattr(aten, f"{name}_pad{n}d_backward").default

            def f(self, padding, _mode=mode):
                return _pad_gather(self, padding, _mode)

            def b(grad_output, self, padding, _mode=mode):
                return _pad_scatter(grad_output, self, padding, _mode)

            lower(fwd)(f)
            lower(bwd)(b)


_register_pads()


@lower(aten._pad_circular.default)
def _pad_circular(self, pad):
    return _pad_gather(self, pad, "circular")


# ----------------------------------------------------------------------------- *_scatter


@lower(aten.select_scatter.default)
def select_scatter(self, src, dim, index):
    dim = _dim(dim, self.ndim)
    if index < 0:
        index += self.shape[dim]
    return self.at[(slice(None),) * dim + (index,)].set(src.astype(self.dtype))


@lower(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, self.ndim)
    start, end, step = slice(start, end, step).indices(self.shape[dim])
    return self.at[(slice(None),) * dim + (slice(start, end, step),)].set(src.astype(self.dtype))


def _positions(shape):
    return jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)


@lower(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    pos = jnp.diagonal(_positions(self.shape), offset, _dim(dim1, self.ndim), _dim(dim2, self.ndim))
    return self.reshape(-1).at[pos.reshape(-1)].set(src.astype(self.dtype).reshape(-1)).reshape(self.shape)


def _strided_positions(size, stride, offset):
    idx = np.full(tuple(size), offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return idx


@lower(aten.as_strided_scatter.default, prims.as_strided_scatter.default)
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    idx = _strided_positions(size, stride, storage_offset)
    flat = self.reshape(-1).at[jnp.asarray(idx.reshape(-1))].set(src.astype(self.dtype).reshape(-1))
    return flat.reshape(self.shape)


# ----------------------------------------------------------------------------- diagonals


@lower(aten.diag.default)
def diag(self, diagonal=0):
    if self.ndim == 1:
        return jnp.diag(self, diagonal)
    return jnp.diagonal(self, diagonal)


@lower(aten.diagflat.default)
def diagflat(self, offset=0):
    return jnp.diag(self.reshape(-1), offset)


@lower(aten.diag_embed.default)
def diag_embed(self, offset=0, dim1=-2, dim2=-1):
    nd = self.ndim + 1
    d1, d2 = _dim(dim1, nd), _dim(dim2, nd)
    m = self.shape[-1]
    n = m + abs(offset)
    rows = np.arange(m) + max(-offset, 0)
    cols = np.arange(m) + max(offset, 0)
    out = jnp.zeros(self.shape[:-1] + (n, n), self.dtype).at[..., rows, cols].set(self)
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


@lower(aten.block_diag.default)
def block_diag(tensors):
    tensors = list(tensors)
    dtype = _result_dtype(tensors)
    mats = []
    for t in tensors:
        if t.ndim == 0:
            t = t.reshape(1, 1)
        elif t.ndim == 1:
            t = t.reshape(1, -1)
        mats.append(t.astype(dtype))
    rows = sum(m.shape[0] for m in mats)
    cols = sum(m.shape[1] for m in mats)
    out = jnp.zeros((rows, cols), dtype)
    r = c = 0
    for m in mats:
        out = lax.dynamic_update_slice(out, m, (r, c)) if m.size else out
        r += m.shape[0]
        c += m.shape[1]
    return out


# ----------------------------------------------------------------------------- copies of views


@lower(aten.narrow_copy.default, aten.narrow.default)
def narrow_copy(self, dim, start, length):
    dim = _dim(dim, self.ndim)
    if start < 0:
        start += self.shape[dim]
    return lax.slice_in_dim(self, start, start + length, axis=dim)


@lower(aten.unfold_backward.default)
def unfold_backward(grad_in, input_sizes, dim, size, step):
    input_sizes = tuple(input_sizes)
    nd = len(input_sizes)
    if nd == 0:
        return grad_in.reshape(())
    dim = _dim(dim, nd)
    n = grad_in.shape[dim]
    idx = np.arange(n)[:, None] * step + np.arange(size)[None, :]
    g = jnp.moveaxis(grad_in, -1, dim + 1)
    compute = jnp.float32 if grad_in.dtype in (jnp.bfloat16, jnp.float16) else grad_in.dtype
    out = jnp.zeros(input_sizes, compute).at[(slice(None),) * dim + (jnp.asarray(idx),)].add(g.astype(compute))
    return out.astype(grad_in.dtype)


# ----------------------------------------------------------------------------- *_like


@lower(aten.empty_like.default)
def empty_like(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    # full_like / zeros_like / ones_like live in factory.py
    from ..dtypes import to_jax_dtype

    return jnp.zeros(self.shape, to_jax_dtype(dtype) if dtype is not None else self.dtype)


# ----------------------------------------------------------------------------- prims shape ops


@lower(prims.broadcast_in_dim.default)
def broadcast_in_dim(a, shape, broadcast_dimensions):
    return lax.broadcast_in_dim(a, tuple(shape), tuple(broadcast_dimensions))


@lower(prims.reshape.default)
def prims_reshape(a, shape):
    return jnp.reshape(a, tuple(shape))


@lower(prims.collapse_view.default, prims.collapse.default)
def collapse(a, start, end):
    if a.ndim == 0:
        return a.reshape(1)
    shape = a.shape[:start] + (math.prod(a.shape[start:end]),) + a.shape[end:]
    return a.reshape(shape)


@lower(prims.split_dim.default)
def split_dim(a, dim, outer_length):
    inner = a.shape[dim] // outer_length if outer_length else 0
    return a.reshape(a.shape[:dim] + (outer_length, inner) + a.shape[dim + 1 :])


@lower(prims.squeeze.default)
def prims_squeeze(a, dimensions):
    return jnp.squeeze(a, tuple(dimensions)) if dimensions else a


@lower(prims.transpose.default)
def prims_transpose(a, permutation):
    return jnp.transpose(a, tuple(permutation))


@lower(prims.view_of.default)
def view_of(a):
    return a


@lower(prims.iota.default)
def iota(length, start=0, step=1, dtype=None, device=None, requires_grad=False):
    from ..dtypes import to_jax_dtype

    jdt = to_jax_dtype(dtype) if dtype is not None else jnp.int64
    return (start + step * lax.iota(jdt, length)).astype(jdt)


@lower(prims.copy_to.default)
def copy_to(a, b):
    new = jnp.broadcast_to(b.astype(a.dtype), a.shape)
    return new, new
