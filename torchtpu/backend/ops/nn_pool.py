"""Pooling: max (with PyTorch's flattened indices), average, adaptive, unpooling.

Windows are built from static per-dimension index tables (numpy at trace time): for each
spatial dimension an (out, k) table of input positions and a validity mask. Gathering with
them gives (..., out_1, k_1, out_2, k_2, ...) which reduces to the pooled value; the argmax
position maps back to the flat index into the input's spatial plane, exactly the index
PyTorch returns. Backward ops scatter-add through those indices or use the VJP.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..registry import aten, lower

_LOW = (jnp.bfloat16, jnp.float16)


def _tup(v, n, default=None):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        v = default
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def pool_out_size(L, k, s, p, d, ceil_mode):
    num = L + 2 * p - d * (k - 1) - 1
    if ceil_mode:
        out = -(-num // s) + 1
        if (out - 1) * s >= L + p:
            out -= 1
    else:
        out = num // s + 1
    return out


def _lowest(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf
    if dtype == jnp.bool_:
        return False
    return jnp.iinfo(dtype).min


def _gather_windows(x, tables, n):
    """x: (..., L_1..L_n). tables: per dim (pos (out,k) int array clipped, valid mask).
    Returns windows (..., out_1..out_n, K) and the (out_1..out_n, K) flat input index and
    validity."""
    lead = x.ndim - n
    spatial = x.shape[lead:]
    win = x
    # gather dimension by dimension: dim i (out_i, k_i) replaces L_i
    for i, (pos, _) in enumerate(tables):
        axis = lead + 2 * i  # previous dims each became two axes
        win = jnp.take(win, jnp.asarray(pos.reshape(-1)), axis=axis)
        win = win.reshape(win.shape[:axis] + pos.shape + win.shape[axis + 1 :])
    # now (..., o1, k1, o2, k2, ...) -> (..., o1, o2, ..., k1*k2*...)
    perm = list(range(lead)) + [lead + 2 * i for i in range(n)] + [lead + 2 * i + 1 for i in range(n)]
    win = jnp.transpose(win, perm)
    outs = tuple(t[0].shape[0] for t in tables)
    ks = tuple(t[0].shape[1] for t in tables)
    win = win.reshape(win.shape[:lead] + outs + (math.prod(ks),))
    # static flat index and validity, shaped (outs..., K)
    flat = np.zeros(outs + ks, np.int64)
    valid = np.ones(outs + ks, bool)
    mult = 1
    for i in reversed(range(n)):
        pos, ok = tables[i]
        shape = [1] * (2 * n)
        shape[i] = pos.shape[0]
        shape[n + i] = pos.shape[1]
        flat = flat + pos.reshape(shape) * mult
        valid = valid & ok.reshape(shape)
        mult *= spatial[i]
    return win, flat.reshape(outs + (-1,)), valid.reshape(outs + (-1,))


def _window_tables(spatial, kernel, stride, padding, dilation, ceil_mode):
    tables = []
    for L, k, s, p, d in zip(spatial, kernel, stride, padding, dilation):
        out = pool_out_size(L, k, s, p, d, ceil_mode)
        pos = np.arange(out)[:, None] * s - p + np.arange(k)[None, :] * d
        ok = (pos >= 0) & (pos < L)
        tables.append((np.clip(pos, 0, max(L - 1, 0)), ok))
    return tables


def _max_with_indices(win, flat, valid, dtype):
    low = _lowest(dtype)
    win = jnp.where(jnp.asarray(valid), win, jnp.asarray(low, dtype))
    if jnp.issubdtype(dtype, jnp.floating):
        # PyTorch takes a NaN as the maximum
        nan = jnp.isnan(win)
        key = jnp.where(nan, jnp.inf, win)
        arg = jnp.argmax(jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan.astype(win.dtype), key), axis=-1)
    else:
        arg = jnp.argmax(win, axis=-1)
    vals = jnp.take_along_axis(win, arg[..., None], axis=-1)[..., 0]
    idx = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), win.shape), arg[..., None], axis=-1)[..., 0]
    return vals, idx


def max_pool_nd(x, n, kernel_size, stride, padding, dilation, ceil_mode):
    kernel = _tup(kernel_size, n)
    stride = _tup(stride, n, kernel)
    padding = _tup(padding, n, [0])
    dilation = _tup(dilation, n, [1])
    tables = _window_tables(x.shape[x.ndim - n :], kernel, stride, padding, dilation, ceil_mode)
    win, flat, valid = _gather_windows(x, tables, n)
    return _max_with_indices(win, flat, valid, x.dtype)


@lower(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool_nd(self, 2, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool_nd(self, 3, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool1d_with_indices.default)
def max_pool1d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool_nd(self, 1, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool1d.default)
def max_pool1d(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool_nd(self, 1, kernel_size, stride, padding, dilation, ceil_mode)[0]


@lower(aten.max_pool2d.default)
def max_pool2d(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool_nd(self, 2, kernel_size, stride, padding, dilation, ceil_mode)[0]


@lower(aten.max_pool3d.default)
def max_pool3d(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool_nd(self, 3, kernel_size, stride, padding, dilation, ceil_mode)[0]


def _scatter_to_input(grad_output, self, indices, n):
    """grad_input[..., indices] += grad_output, over the flattened spatial plane."""
    lead = self.shape[: self.ndim - n]
    plane = math.prod(self.shape[self.ndim - n :])
    g = grad_output.reshape(lead + (-1,))
    idx = indices.reshape(lead + (-1,)).astype(jnp.int32)
    acc = jnp.float32 if g.dtype in _LOW else g.dtype
    out = jnp.zeros(lead + (plane,), acc)
    b = math.prod(lead)
    out = out.reshape(b, plane)
    rows = jnp.arange(b)[:, None]
    out = out.at[rows, idx.reshape(b, -1)].add(g.reshape(b, -1).astype(acc))
    return out.reshape(self.shape).astype(self.dtype)


@lower(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_to_input(grad_output, self, indices, 2)


@lower(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_to_input(grad_output, self, indices, 3)


@lower(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _scatter_to_input(grad_output, self, indices, 2)


@lower(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _scatter_to_input(grad_output, self, indices, 3)


# ----------------------------------------------------------------------------- adaptive pooling


def _adaptive_ranges(L, out):
    start = (np.arange(out) * L) // out
    end = -((-(np.arange(out) + 1) * L) // out)
    return start, end


def _adaptive_tables(spatial, output_size):
    tables = []
    for L, o in zip(spatial, output_size):
        start, end = _adaptive_ranges(L, o)
        k = int((end - start).max()) if o else 1
        pos = start[:, None] + np.arange(k)[None, :]
        ok = pos < end[:, None]
        tables.append((np.clip(pos, 0, max(L - 1, 0)), ok))
    return tables


def adaptive_max_nd(x, n, output_size):
    output_size = [x.shape[x.ndim - n + i] if o is None else o for i, o in enumerate(_tup(output_size, n))]
    tables = _adaptive_tables(x.shape[x.ndim - n :], output_size)
    win, flat, valid = _gather_windows(x, tables, n)
    return _max_with_indices(win, flat, valid, x.dtype)


def _adaptive(pool_nd, n, *ops):
    """Register `pool_nd(x, n, output_size)`, adaptive pooling over the last n dims, for `ops`."""

    def low(self, output_size):
        return pool_nd(self, n, output_size)

    lower(*ops)(low)


_adaptive(adaptive_max_nd, 1, aten.adaptive_max_pool1d.default)
_adaptive(adaptive_max_nd, 2, aten.adaptive_max_pool2d.default)
_adaptive(adaptive_max_nd, 3, aten.adaptive_max_pool3d.default)


def _adaptive_matrix(L, o, dtype):
    start, end = _adaptive_ranges(L, o)
    m = np.zeros((o, L), np.float64)
    for i in range(o):
        m[i, start[i] : end[i]] = 1.0 / (end[i] - start[i])
    return m


def adaptive_avg_nd(x, n, output_size):
    output_size = [x.shape[x.ndim - n + i] if o is None else o for i, o in enumerate(_tup(output_size, n))]
    acc = jnp.float32 if x.dtype in _LOW else x.dtype
    y = x.astype(acc)
    lead = x.ndim - n
    for i in range(n):
        L, o = x.shape[lead + i], output_size[i]
        start, end = _adaptive_ranges(L, o)
        if o == L:
            continue
        if np.all(end - start == (end - start)[0]) and np.all(start == np.arange(o) * (end - start)[0]):
            # non-overlapping equal windows: a reshape and a mean
            k = int((end - start)[0])
            axis = lead + i
            y = y.reshape(y.shape[:axis] + (o, k) + y.shape[axis + 1 :])
            y = jnp.sum(y, axis=axis + 1) / k
            continue
        m = jnp.asarray(_adaptive_matrix(L, o, acc), acc)
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=[[lead + i], [1]], precision=lax.Precision.HIGHEST), -1, lead + i)
    return y.astype(x.dtype)


_adaptive(adaptive_avg_nd, 1, aten.adaptive_avg_pool1d.default)
_adaptive(adaptive_avg_nd, 2, aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool2d.default)
_adaptive(adaptive_avg_nd, 3, aten._adaptive_avg_pool3d.default, aten.adaptive_avg_pool3d.default)


def _adaptive_avg_backward(n, op):
    """Register for `op` the gradient of adaptive average pooling over the last n dims."""

    def low(grad_output, self):
        _, vjp = jax.vjp(lambda x: adaptive_avg_nd(x, n, grad_output.shape[-n:]), self)
        return vjp(grad_output.astype(self.dtype))[0]

    lower(op)(low)


_adaptive_avg_backward(2, aten._adaptive_avg_pool2d_backward.default)
_adaptive_avg_backward(3, aten._adaptive_avg_pool3d_backward.default)


# ----------------------------------------------------------------------------- average pooling


def avg_pool_nd(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel = _tup(kernel_size, n)
    stride = _tup(stride, n, kernel)
    padding = _tup(padding, n, [0])
    lead = x.ndim - n
    spatial = x.shape[lead:]
    acc = jnp.float32 if x.dtype in _LOW else x.dtype
    outs, pads, counts = [], [], []
    for L, k, s, p in zip(spatial, kernel, stride, padding):
        o = pool_out_size(L, k, s, p, 1, ceil_mode)
        extra = max(0, (o - 1) * s + k - (L + 2 * p))
        outs.append(o)
        pads.append((p, p + extra))
        start = np.arange(o) * s - p
        end = np.minimum(start + k, L + p)
        incl = end - start
        excl = np.minimum(end, L) - np.maximum(start, 0)
        counts.append(incl if count_include_pad else excl)
    y = lax.reduce_window(
        x.astype(acc),
        np.array(0, acc),
        lax.add,
        (1,) * lead + tuple(kernel),
        (1,) * lead + tuple(stride),
        [(0, 0)] * lead + pads,
    )
    if divisor_override:
        return (y / divisor_override).astype(x.dtype)
    div = np.ones(outs, np.float64)
    for i, c in enumerate(counts):
        shape = [1] * n
        shape[i] = len(c)
        div = div * c.reshape(shape)
    return (y / jnp.asarray(div, acc)).astype(x.dtype)


@lower(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return avg_pool_nd(self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lower(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return avg_pool_nd(self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lower(aten.avg_pool1d.default)
def avg_pool1d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True):
    return avg_pool_nd(self, 1, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


def _avg_pool_backward(n, op):
    """Register for `op` the gradient of average pooling over the last n dims."""

    def low(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
        _, vjp = jax.vjp(
            lambda x: avg_pool_nd(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override),
            self,
        )
        return vjp(grad_output.astype(self.dtype))[0]

    lower(op)(low)


_avg_pool_backward(2, aten.avg_pool2d_backward.default)
_avg_pool_backward(3, aten.avg_pool3d_backward.default)


# ----------------------------------------------------------------------------- unpooling


def _unpool(self, indices, output_size, n):
    lead = self.shape[: self.ndim - n]
    plane = math.prod(output_size)
    b = math.prod(lead)
    vals = self.reshape(b, -1)
    idx = indices.reshape(b, -1)
    out = jnp.zeros((b, plane), self.dtype)
    rows = jnp.arange(b)[:, None]
    out = out.at[rows, idx].set(vals, mode="drop")
    return out.reshape(lead + tuple(output_size))


@lower(aten.max_unpool2d.default)
def max_unpool2d(self, indices, output_size):
    return _unpool(self, indices, list(output_size), 2)


@lower(aten.max_unpool3d.default)
def max_unpool3d(self, indices, output_size, stride, padding):
    return _unpool(self, indices, list(output_size), 3)


# ----------------------------------------------------------------------------- fractional max pooling


def _fractional_starts(sample, L, o, k):
    """PyTorch's interval sequence for one dimension; `sample` has any leading shape."""
    if o <= 1:
        return jnp.full(sample.shape + (max(o, 0),), L - k, jnp.int32)
    alpha = jnp.asarray(L - k, sample.dtype) / jnp.asarray(o - 1, sample.dtype)
    i = jnp.arange(o - 1, dtype=sample.dtype)
    s = sample[..., None]
    seq = (jnp.trunc((i + s) * alpha) - jnp.trunc(s * alpha)).astype(jnp.int32)
    last = jnp.full(sample.shape + (1,), L - k, jnp.int32)
    return jnp.concatenate([seq, last], axis=-1)


def fractional_max_nd(x, n, kernel_size, output_size, random_samples):
    unbatched = x.ndim == n + 1
    if unbatched:
        x = x[None]
    N, C = x.shape[:2]
    spatial = x.shape[2:]
    kernel = _tup(kernel_size, n)
    outs = _tup(output_size, n)
    samples = random_samples.astype(x.dtype if x.dtype not in _LOW else jnp.float32).reshape(N, C, n)
    # PyTorch pairs sample 0 with the last spatial dim for 2-D pooling, with the first for 3-D
    order = [1, 0] if n == 2 else list(range(n))
    flat = jnp.zeros((N, C) + tuple(outs) + tuple(kernel), jnp.int32)
    mult = 1
    for d in reversed(range(n)):
        L, o, k = spatial[d], outs[d], kernel[d]
        starts = _fractional_starts(samples[..., order[d]], L, o, k)  # (N, C, o)
        pos = starts[..., None] + jnp.arange(k, dtype=jnp.int32)  # (N, C, o, k)
        shape = [N, C] + [1] * (2 * n)
        shape[2 + d] = o
        shape[2 + n + d] = k
        flat = flat + pos.reshape(shape) * mult
        mult *= L
    idx = flat.reshape(N, C, -1)
    vals = jnp.take_along_axis(x.reshape(N, C, -1), idx, axis=2).reshape(flat.shape)
    vals = vals.reshape((N, C) + tuple(outs) + (-1,))
    flat = flat.reshape((N, C) + tuple(outs) + (-1,))
    nan = jnp.isnan(vals) if jnp.issubdtype(vals.dtype, jnp.floating) else jnp.zeros(vals.shape, bool)
    key = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan.astype(vals.dtype), vals)
    arg = jnp.argmax(key, axis=-1)[..., None]
    out = jnp.take_along_axis(vals, arg, axis=-1)[..., 0]
    ind = jnp.take_along_axis(flat, arg, axis=-1)[..., 0].astype(jnp.int64)
    if unbatched:
        out, ind = out[0], ind[0]
    return out, ind


@lower(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    return fractional_max_nd(self, 2, kernel_size, output_size, random_samples)


@lower(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    return fractional_max_nd(self, 3, kernel_size, output_size, random_samples)


@lower(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return _scatter_to_input(grad_output, self, indices, 2)


@lower(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return _scatter_to_input(grad_output, self, indices, 3)
