"""View ops: how each view reads its values from the tensor it views.

The dispatcher keeps aliasing (see backend/tensor.py); these functions only say how to read
the view from its parent's array. Writes through views reuse them on an index array.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..registry import aten, lower

prims = torch.ops.prims


def _dim(d, ndim):
    return d + ndim if d < 0 else d


def _infer_shape(shape, size):
    shape = list(shape)
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        shape[shape.index(-1)] = size // known if known else 0
    return tuple(shape)


@lower(
    aten.view.default,
    aten._unsafe_view.default,
    aten._reshape_alias.default,
    aten.reshape.default,
    aten.view_copy.default,
)
def view(self, size, stride=None):
    return jnp.reshape(self, _infer_shape(size, self.size))


@lower(
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
    aten.alias_copy.default,
    aten.detach_copy.default,
    aten.clone.default,
    aten.positive.default,
    aten.resolve_conj.default,
    aten.resolve_neg.default,
)
def alias(self, memory_format=None):
    return self


@lower(aten.conj.default, aten._conj.default, aten.conj_physical.default)
def conj(self):
    return jnp.conj(self) if jnp.iscomplexobj(self) else self


@lower(aten.permute.default, aten.permute_copy.default)
def permute(self, dims):
    return jnp.transpose(self, [_dim(d, self.ndim) for d in dims])


@lower(aten.transpose.int, aten.transpose_copy.int)
def transpose(self, dim0, dim1):
    if self.ndim == 0:
        return self
    return jnp.swapaxes(self, _dim(dim0, self.ndim), _dim(dim1, self.ndim))


@lower(aten.t.default, aten.t_copy.default)
def t(self):
    return self if self.ndim < 2 else self.T


@lower(aten.expand.default, aten.expand_copy.default)
def expand(self, size, implicit=False):
    size = list(size)
    lead = len(size) - self.ndim
    shape = [s if s != -1 else self.shape[i - lead] for i, s in enumerate(size)]
    return jnp.broadcast_to(self, tuple(shape))


@lower(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(self, dim=0, start=None, end=None, step=1):
    if self.ndim == 0:
        return self
    dim = _dim(dim, self.ndim)
    n = self.shape[dim]
    start, end, step = slice(start, end, step).indices(n) if step > 0 else (0, 0, 1)
    if end < start:
        end = start
    return lax.slice_in_dim(self, start, end, step, axis=dim)


@lower(aten.select.int, aten.select_copy.int)
def select(self, dim, index):
    dim = _dim(dim, self.ndim)
    if index < 0:
        index += self.shape[dim]
    return lax.index_in_dim(self, index, axis=dim, keepdims=False)


@lower(
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze_copy.default,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.dims,
)
def squeeze(self, dim=None):
    if self.ndim == 0:
        return self
    if dim is None:
        dims = tuple(i for i, s in enumerate(self.shape) if s == 1)
    else:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        dims = tuple(d for d in (_dim(d, self.ndim) for d in dims) if self.shape[d] == 1)
    return jnp.squeeze(self, dims) if dims else self


@lower(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, _dim(dim, self.ndim + 1))


@lower(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(self, offset, _dim(dim1, self.ndim), _dim(dim2, self.ndim))


@lower(aten.unfold.default, aten.unfold_copy.default)
def unfold(self, dimension, size, step):
    if self.ndim == 0:
        return self.reshape(1)
    d = _dim(dimension, self.ndim)
    n = (self.shape[d] - size) // step + 1
    starts = np.arange(n) * step
    idx = starts[:, None] + np.arange(size)[None, :]
    out = jnp.take(self, idx.reshape(-1), axis=d)
    out = out.reshape(self.shape[:d] + (n, size) + self.shape[d + 1 :])
    return jnp.moveaxis(out, d + 1, -1)


@lower(aten.as_strided.default, aten.as_strided_copy.default)
def as_strided(self, size, stride, storage_offset=None):
    # Reads relative to the contiguous layout of the array it is applied to (the storage
    # base), which is what PyTorch's as_strided means for our always-contiguous bases.
    offset = storage_offset or 0
    idx = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return jnp.take(self.reshape(-1), idx.reshape(-1) if idx.size else idx.reshape(-1)).reshape(tuple(size))


@lower(aten.split.Tensor, aten.split_copy.Tensor)
def split(self, split_size, dim=0):
    dim = _dim(dim, max(self.ndim, 1))
    n = self.shape[dim]
    if split_size == 0:
        return [self]
    bounds = list(range(0, n, split_size)) or [0]
    return [lax.slice_in_dim(self, b, min(b + split_size, n), axis=dim) for b in bounds]


@lower(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def split_with_sizes(self, split_sizes, dim=0):
    dim = _dim(dim, self.ndim)
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(self, start, start + s, axis=dim))
        start += s
    return out


@lower(aten.unbind.int, aten.unbind_copy.int)
def unbind(self, dim=0):
    dim = _dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, axis=dim, keepdims=False) for i in range(self.shape[dim])]


@lower(aten.chunk.default)
def chunk(self, chunks, dim=0):
    dim = _dim(dim, self.ndim)
    n = self.shape[dim]
    size = -(-n // chunks)
    return split(self, size, dim)


@lower(aten.view.dtype)
def view_dtype(self, dtype):
    from ..dtypes import to_jax_dtype

    jdt = to_jax_dtype(dtype)
    if jdt.itemsize == self.dtype.itemsize:
        return lax.bitcast_convert_type(self, jdt)
    if jdt.itemsize < self.dtype.itemsize:
        r = self.dtype.itemsize // jdt.itemsize
        out = lax.bitcast_convert_type(self, jdt)
        return out.reshape(self.shape[:-1] + (self.shape[-1] * r,))
    r = jdt.itemsize // self.dtype.itemsize
    return lax.bitcast_convert_type(self.reshape(self.shape[:-1] + (self.shape[-1] // r, r)), jdt)


@lower(aten.view_as_real.default, aten.view_as_real_copy.default)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lower(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


@lower(aten.real.default, prims.real.default)
def real(self):
    return jnp.real(self)


@lower(aten.imag.default, prims.imag.default)
def imag(self):
    return jnp.imag(self)
