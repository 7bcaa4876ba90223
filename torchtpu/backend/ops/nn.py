"""Other neural-network ops: dropout, resampling (upsample_*, grid_sampler_2d), im2col/col2im,
pixel (un)shuffle, embedding_bag. Convolutions, norms, pooling and losses live in nn_conv.py,
nn_norm.py, nn_pool.py and nn_loss.py.

Resampling uses static index/weight tables computed with numpy at trace time in the same
precision PyTorch's CPU kernels use, applied one spatial dimension at a time. Backward
ops are VJPs of the forward lowerings (these ops are linear in their input).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..registry import POST, aten, bind, custom, lower
from . import attention_tpu

_LOW = (jnp.bfloat16, jnp.float16)


def _acc_dtype(x):
    return jnp.float32 if x.dtype in _LOW else x.dtype


# ----------------------------------------------------------------------------- dropout


@lower(aten.native_dropout.default, random=True)
def native_dropout(input, p, train, *, key):
    if train is False:  # None means training, as in ATen
        return input, jnp.ones(input.shape, jnp.bool_)
    if p >= 1:
        return jnp.zeros_like(input), jnp.zeros(input.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1.0 - p, input.shape)
    scale = 1.0 / (1.0 - p)
    out = jnp.where(keep, input * jnp.asarray(scale, _acc_dtype(input)).astype(input.dtype), 0)
    return out.astype(input.dtype), keep


@lower(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output, mask, scale):
    return (grad_output * mask.astype(grad_output.dtype) * scale).astype(grad_output.dtype)


# ----------------------------------------------------------------------------- upsampling


def _np_dtype(x):
    return np.float64 if x.dtype == jnp.float64 else np.float32


def _scale_value(scale, L, o, ftype):
    # PyTorch: 1/scale when a scale was given (and > 0), else in/out
    if scale is not None and scale > 0:
        return ftype(1.0 / scale)
    return ftype(L) / ftype(o) if o else ftype(0)


def _nearest_index(L, o, scale, exact, ftype):
    s = _scale_value(scale, L, o, ftype)
    dst = np.arange(o).astype(ftype)
    if exact:
        src = np.floor((dst + ftype(0.5)) * s).astype(np.int64)
    else:
        src = np.floor(dst * s).astype(np.int64)
    return np.minimum(src, L - 1)


def _linear_source(L, o, align_corners, scale, cubic, ftype):
    if align_corners:
        s = ftype(L - 1) / ftype(o - 1) if o > 1 else ftype(0)
        src = s * np.arange(o).astype(ftype)
    else:
        s = _scale_value(scale, L, o, ftype)
        src = s * (np.arange(o).astype(ftype) + ftype(0.5)) - ftype(0.5)
        if not cubic:
            src = np.maximum(src, ftype(0))
    return src.astype(ftype)


def _take(x, idx, axis):
    return jnp.take(x, jnp.asarray(idx), axis=axis)


def _bshape(n_axes, axis, length):
    shape = [1] * n_axes
    shape[axis] = length
    return shape


def _resample_dim(x, axis, L, o, mode, align_corners, scale, ftype):
    if mode in ("nearest", "nearest-exact"):
        return _take(x, _nearest_index(L, o, scale, mode == "nearest-exact", ftype), axis)
    if mode == "linear":
        src = _linear_source(L, o, align_corners, scale, False, ftype)
        i0 = np.minimum(np.floor(src).astype(np.int64), L - 1)
        i1 = np.minimum(i0 + 1, L - 1)
        l1 = (src - i0.astype(ftype)).astype(ftype)
        l0 = (ftype(1) - l1).astype(ftype)
        shp = _bshape(x.ndim, axis, o)
        return _take(x, i0, axis) * jnp.asarray(l0.reshape(shp), x.dtype) + _take(x, i1, axis) * jnp.asarray(
            l1.reshape(shp), x.dtype
        )
    if mode == "cubic":
        src = _linear_source(L, o, align_corners, scale, True, ftype)
        fl = np.floor(src)
        t = (src - fl).astype(ftype)
        i = fl.astype(np.int64)
        A = ftype(-0.75)

        def cc1(v):
            return ((A + 2) * v - (A + 3)) * v * v + 1

        def cc2(v):
            return ((A * v - 5 * A) * v + 8 * A) * v - 4 * A

        ws = [cc2(t + 1), cc1(t), cc1(1 - t), cc2(2 - t)]
        shp = _bshape(x.ndim, axis, o)
        out = 0
        for k in range(4):
            idx = np.clip(i - 1 + k, 0, L - 1)
            out = out + _take(x, idx, axis) * jnp.asarray(ws[k].astype(ftype).reshape(shp), x.dtype)
        return out
    raise NotImplementedError(f"torchtpu: upsampling mode {mode!r} is not supported")


def upsample(x, output_size, scales, mode, align_corners=False):
    n = len(output_size)
    lead = x.ndim - n
    ftype = _np_dtype(x)
    y = x.astype(_acc_dtype(x)) if mode not in ("nearest", "nearest-exact") else x
    for i in range(n):
        axis = lead + i
        sc = scales[i] if scales else None
        y = _resample_dim(y, axis, x.shape[axis], output_size[i], mode, align_corners, sc, ftype)
    return y.astype(x.dtype)


def _out_size(input, n, output_size, scale_factors):
    if output_size is not None:
        return list(output_size), None
    spatial = input.shape[input.ndim - n :]
    sf = list(scale_factors)
    return [int(math.floor(float(s) * f)) for s, f in zip(spatial, sf)], sf


def _reg_upsample(n, name, mode, has_align):
    default = getattr(aten, name).default
    vec = getattr(aten, name).vec
    bwd = getattr(aten, name + "_backward").default

    if has_align:

        @lower(default)
        def fwd(self, output_size, align_corners, *scales):
            return upsample(self, list(output_size), list(scales) if scales else None, mode, align_corners)

        @lower(vec)
        def fwd_vec(input, output_size, align_corners, scale_factors):
            size, sc = _out_size(input, n, output_size, scale_factors)
            return upsample(input, size, sc, mode, align_corners)

        @lower(bwd)
        def backward(grad_output, output_size, input_size, align_corners, *scales):
            x = jnp.zeros(tuple(input_size), grad_output.dtype)
            _, vjp = jax.vjp(
                lambda t: upsample(t, list(output_size), list(scales) if scales else None, mode, align_corners), x
            )
            return vjp(grad_output)[0]
    else:

        @lower(default)
        def fwd(self, output_size, *scales):
            return upsample(self, list(output_size), list(scales) if scales else None, mode)

        @lower(vec)
        def fwd_vec(input, output_size, scale_factors):
            size, sc = _out_size(input, n, output_size, scale_factors)
            return upsample(input, size, sc, mode)

        @lower(bwd)
        def backward(grad_output, output_size, input_size, *scales):
            x = jnp.zeros(tuple(input_size), grad_output.dtype)
            _, vjp = jax.vjp(lambda t: upsample(t, list(output_size), list(scales) if scales else None, mode), x)
            return vjp(grad_output)[0]


for _n in (1, 2, 3):
    _reg_upsample(_n, f"upsample_nearest{_n}d", "nearest", False)
    _reg_upsample(_n, f"_upsample_nearest_exact{_n}d", "nearest-exact", False)
_reg_upsample(1, "upsample_linear1d", "linear", True)
_reg_upsample(2, "upsample_bilinear2d", "linear", True)
_reg_upsample(3, "upsample_trilinear3d", "linear", True)
_reg_upsample(2, "upsample_bicubic2d", "cubic", True)


def _aa_weights(L, o, align_corners, scale, ftype):
    """(o, L) matrix of PyTorch's antialiased linear interpolation: when downsampling, each output
    averages a window as wide as the scale with a triangle filter stretched by it; the weights of
    a window are normalised to sum to 1."""
    if align_corners:
        s = ftype(L - 1) / ftype(o - 1) if o > 1 else ftype(0)
    else:
        s = _scale_value(scale, L, o, ftype)
    support = s if s >= 1 else ftype(1)  # interpolation size 2, times the scale when shrinking
    invscale = 1 / s if s >= 1 else ftype(1)
    w = np.zeros((o, L), ftype)
    for i in range(o):
        center = s * (i + ftype(0.5))
        lo = max(int(center - support + ftype(0.5)), 0)
        hi = min(int(center + support + ftype(0.5)), L)
        j = np.arange(lo, hi)
        k = np.maximum(0, 1 - np.abs((j - center + ftype(0.5)) * invscale)).astype(ftype)
        total = k.sum()
        w[i, lo:hi] = k / total if total != 0 else k
    return w


def _upsample_aa(x, output_size, align_corners, scales):
    ftype = _np_dtype(x)
    (oh, ow), (sh, sw) = output_size, scales or (None, None)
    wh = _aa_weights(x.shape[-2], oh, align_corners, sh, ftype)
    ww = _aa_weights(x.shape[-1], ow, align_corners, sw, ftype)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    out = jnp.einsum("oh,nchw,pw->ncop", wh, x.astype(acc), ww, precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)


@lower(aten._upsample_bilinear2d_aa.default)
def upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(self, list(output_size), align_corners, (scales_h, scales_w))


@lower(aten._upsample_bilinear2d_aa.vec)
def upsample_bilinear2d_aa_vec(input, output_size, align_corners, scale_factors):
    size, sf = _out_size(input, 2, output_size, scale_factors)
    return _upsample_aa(input, size, align_corners, sf)


@lower(aten._upsample_bilinear2d_aa_backward.default)
def upsample_bilinear2d_aa_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    x = jnp.zeros(tuple(input_size), grad_output.dtype)
    _, vjp = jax.vjp(lambda t: _upsample_aa(t, list(output_size), align_corners, (scales_h, scales_w)), x)
    return vjp(grad_output)[0]


# ----------------------------------------------------------------------------- im2col / col2im


def _im2col(x, kernel_size, dilation, padding, stride):
    batched = x.ndim == 4
    if not batched:
        x = x[None]
    n, c, h, w = x.shape
    kh, kw = kernel_size
    dh, dw = dilation
    ph, pw = padding
    sh, sw = stride
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    xp = jnp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    cols = []
    for i in range(kh):
        for j in range(kw):
            cols.append(
                lax.slice(
                    xp,
                    (0, 0, i * dh, j * dw),
                    (n, c, i * dh + (oh - 1) * sh + 1, j * dw + (ow - 1) * sw + 1),
                    (1, 1, sh, sw),
                )
            )
    out = jnp.stack(cols, axis=2).reshape(n, c * kh * kw, oh * ow)
    return out if batched else out[0]


@lower(aten.im2col.default)
def im2col(self, kernel_size, dilation, padding, stride):
    return _im2col(self, kernel_size, dilation, padding, stride)


@lower(aten.col2im.default)
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    batched = self.ndim == 3
    c = self.shape[-2] // (kernel_size[0] * kernel_size[1])
    shape = ((self.shape[0],) if batched else ()) + (c,) + tuple(output_size)
    x = jnp.zeros(shape, self.dtype)
    _, vjp = jax.vjp(lambda t: _im2col(t, kernel_size, dilation, padding, stride), x)
    return vjp(self)[0]


# ----------------------------------------------------------------------------- pixel shuffle


@lower(aten.pixel_shuffle.default)
def pixel_shuffle(self, upscale_factor):
    r = upscale_factor
    *lead, c, h, w = self.shape
    oc = c // (r * r)
    x = self.reshape(tuple(lead) + (oc, r, r, h, w))
    k = len(lead)
    x = jnp.transpose(x, tuple(range(k)) + (k, k + 3, k + 1, k + 4, k + 2))
    return x.reshape(tuple(lead) + (oc, h * r, w * r))


@lower(aten.pixel_unshuffle.default)
def pixel_unshuffle(self, downscale_factor):
    r = downscale_factor
    *lead, c, h, w = self.shape
    k = len(lead)
    x = self.reshape(tuple(lead) + (c, h // r, r, w // r, r))
    x = jnp.transpose(x, tuple(range(k)) + (k, k + 2, k + 4, k + 1, k + 3))
    return x.reshape(tuple(lead) + (c * r * r, h // r, w // r))


@lower(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def channel_shuffle(self, groups):
    n, c = self.shape[:2]
    rest = self.shape[2:]
    x = self.reshape((n, groups, c // groups) + rest)
    return jnp.swapaxes(x, 1, 2).reshape(self.shape)


# ----------------------------------------------------------------------------- grid sampler


def _unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, lo2, hi2):
    # reflect coordinates into [lo2/2, hi2/2]
    if lo2 == hi2:
        return jnp.zeros_like(coord)
    mn = lo2 / 2
    span = (hi2 - lo2) / 2
    coord = jnp.abs(coord - mn)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(flips % 2 == 0, extra + mn, span - extra + mn)


def _compute_source(coord, size, padding_mode, align_corners):
    coord = _unnormalize(coord, size, align_corners)
    if padding_mode == 1:  # border
        coord = jnp.clip(coord, 0, size - 1)
    elif padding_mode == 2:  # reflection
        if align_corners:
            coord = _reflect(coord, 0, 2 * (size - 1))
        else:
            coord = _reflect(coord, -1, 2 * size - 1)
        coord = jnp.clip(coord, 0, size - 1)
    return coord


def _grid_sample_2d(input, grid, interpolation_mode, padding_mode, align_corners):
    n, c, h, w = input.shape
    acc = _acc_dtype(input)
    x = input.astype(acc)
    g = grid.astype(acc)
    ix = _compute_source(g[..., 0], w, padding_mode, align_corners)  # (N, Ho, Wo)
    iy = _compute_source(g[..., 1], h, padding_mode, align_corners)
    flat = x.reshape(n, c, h * w)

    def gather(yy, xx):
        # yy, xx integer (N, Ho, Wo); zero outside
        ok = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
        idx = jnp.clip(yy, 0, h - 1) * w + jnp.clip(xx, 0, w - 1)
        vals = jnp.take_along_axis(flat, idx.reshape(n, 1, -1), axis=2).reshape((n, c) + idx.shape[1:])
        return vals * ok[:, None].astype(acc)

    if interpolation_mode == 0:  # bilinear
        x0 = jnp.floor(ix)
        y0 = jnp.floor(iy)
        tx = ix - x0
        ty = iy - y0
        x0i = x0.astype(jnp.int32)
        y0i = y0.astype(jnp.int32)
        out = (
            gather(y0i, x0i) * ((1 - tx) * (1 - ty))[:, None]
            + gather(y0i, x0i + 1) * (tx * (1 - ty))[:, None]
            + gather(y0i + 1, x0i) * ((1 - tx) * ty)[:, None]
            + gather(y0i + 1, x0i + 1) * (tx * ty)[:, None]
        )
    elif interpolation_mode == 1:  # nearest (round half to even, like nearbyint)
        out = gather(jnp.round(iy).astype(jnp.int32), jnp.round(ix).astype(jnp.int32))
    elif interpolation_mode == 2:  # bicubic
        gx = _unnormalize(g[..., 0], w, align_corners)
        gy = _unnormalize(g[..., 1], h, align_corners)
        x0 = jnp.floor(gx)
        y0 = jnp.floor(gy)
        tx = gx - x0
        ty = gy - y0
        A = -0.75

        def coeffs(t):
            def cc1(v):
                return ((A + 2) * v - (A + 3)) * v * v + 1

            def cc2(v):
                return ((A * v - 5 * A) * v + 8 * A) * v - 4 * A

            return [cc2(t + 1), cc1(t), cc1(1 - t), cc2(2 - t)]

        wx = coeffs(tx)
        wy = coeffs(ty)

        def bounded(yy, xx):
            if padding_mode == 0:
                return gather(yy.astype(jnp.int32), xx.astype(jnp.int32))
            xs = _pad_coord(xx, w, padding_mode, align_corners)
            ys = _pad_coord(yy, h, padding_mode, align_corners)
            return gather(ys.astype(jnp.int32), xs.astype(jnp.int32))

        out = 0
        for i in range(4):
            row = 0
            for j in range(4):
                row = row + bounded(y0 - 1 + i, x0 - 1 + j) * wx[j][:, None]
            out = out + row * wy[i][:, None]
    else:
        raise NotImplementedError(f"torchtpu: grid_sampler_2d interpolation_mode={interpolation_mode} is not supported")
    return out.astype(input.dtype)


def _pad_coord(coord, size, padding_mode, align_corners):
    if padding_mode == 1:
        return jnp.clip(coord, 0, size - 1)
    if align_corners:
        coord = _reflect(coord, 0, 2 * (size - 1))
    else:
        coord = _reflect(coord, -1, 2 * size - 1)
    return jnp.clip(coord, 0, size - 1)


@lower(aten.grid_sampler_2d.default)
def grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample_2d(input, grid, interpolation_mode, padding_mode, align_corners)


@lower(aten.grid_sampler_2d_backward.default)
def grid_sampler_2d_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    _, vjp = jax.vjp(lambda a, b: _grid_sample_2d(a, b, interpolation_mode, padding_mode, align_corners), input, grid)
    gi, gg = vjp(grad_output.astype(input.dtype))
    return (gi if output_mask[0] else None), gg


# ----------------------------------------------------------------------------- embedding bag


def _bag_ids(indices, offsets, include_last_offset):
    n = indices.shape[0]
    nb = offsets.shape[0] - (1 if include_last_offset else 0)
    pos = jnp.arange(n)
    bag = jnp.searchsorted(offsets.astype(jnp.int64), pos, side="right") - 1
    if include_last_offset:
        bag = jnp.minimum(bag, nb - 1)
    return bag, nb


def _embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    if indices.ndim == 2:
        b, l = indices.shape
        offsets = jnp.arange(b, dtype=jnp.int64) * l
        indices = indices.reshape(-1)
        include_last_offset = False
    bag, nb = _bag_ids(indices, offsets, include_last_offset)
    acc = _acc_dtype(weight)
    rows = jnp.take(weight, indices, axis=0).astype(acc)
    keep = indices != padding_idx if padding_idx is not None and padding_idx >= 0 else jnp.ones(indices.shape, bool)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(acc)[:, None]
    counts = jax.ops.segment_sum(keep.astype(jnp.int64), bag, nb)
    if mode == 2:
        low = jnp.asarray(-jnp.inf, acc)
        vals = jnp.where(keep[:, None], rows, low)
        out = jax.ops.segment_max(vals, bag, nb)
        out = jnp.where(counts[:, None] > 0, out, 0)
        # index of the max row per bag and column
        is_max = (vals == jnp.take(out, bag, axis=0)) & keep[:, None]
        cand = jnp.where(is_max, indices[:, None], jnp.iinfo(jnp.int64).max)
        maxi = jax.ops.segment_min(cand, bag, nb)
        maxi = jnp.where(counts[:, None] > 0, maxi, 0)
    else:
        rows = jnp.where(keep[:, None], rows, 0)
        out = jax.ops.segment_sum(rows, bag, nb)
        if mode == 1:
            out = out / jnp.maximum(counts, 1)[:, None].astype(acc)
        maxi = jnp.zeros((0,), jnp.int64)
    bag_size = counts.astype(jnp.int64)
    if bag_size.shape[0] < offsets.shape[0]:  # include_last_offset: PyTorch's meta keeps one per offset
        bag_size = jnp.pad(bag_size, (0, offsets.shape[0] - bag_size.shape[0]))
    return out.astype(weight.dtype), bag.astype(jnp.int64), bag_size, maxi.astype(jnp.int64)


@lower(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx=-1,
):
    acc = _acc_dtype(grad)
    g = grad.astype(acc)
    out = jnp.zeros((num_weights, grad.shape[1]), acc)
    if mode == 2:
        cols = jnp.arange(grad.shape[1])[None, :]
        valid = (bag_size[: grad.shape[0]] > 0)[:, None]
        out = out.at[maximum_indices, jnp.broadcast_to(cols, maximum_indices.shape)].add(jnp.where(valid, g, 0))
        return out.astype(grad.dtype)
    rows = jnp.take(g, offset2bag, axis=0)
    if mode == 1:
        rows = rows / jnp.maximum(jnp.take(bag_size, offset2bag), 1)[:, None].astype(acc)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(acc)[:, None]
    if padding_idx is not None and padding_idx >= 0:
        rows = jnp.where((indices != padding_idx)[:, None], rows, 0)
    if scale_grad_by_freq:
        freq = jnp.zeros((num_weights,), acc).at[indices].add(1)
        rows = rows / jnp.take(freq, indices)[:, None]
    return out.at[indices].add(rows).astype(grad.dtype)


@lower(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    acc = _acc_dtype(grad)
    r = jnp.sum(jnp.take(grad, offset2bag, axis=0).astype(acc) * jnp.take(weight, indices, axis=0).astype(acc), axis=1)
    if padding_idx is not None and padding_idx >= 0:
        r = jnp.where(indices != padding_idx, r, 0)
    return r.astype(grad.dtype)


lower(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)(_embedding_bag)


# ----------------------------------------------------------------------------- fused RNN cells
# nn.LSTM / nn.GRU on this device run their cells through these fused ops (as on CUDA).
# The workspace holds the activated gates the backward needs.


def _sig(x):
    return jax.nn.sigmoid(x)


@lower(aten._thnn_fused_lstm_cell.default)
def _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    i, f, g, o = _sig(i), _sig(f), jnp.tanh(g), _sig(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=-1)


@lower(aten._thnn_fused_lstm_cell_backward_impl.default)
def _thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(workspace, 4, axis=-1)
    tcy = jnp.tanh(cy)
    gh = grad_hy if grad_hy is not None else jnp.zeros_like(cy)
    gc = grad_cy if grad_cy is not None else jnp.zeros_like(cy)
    gcy = gh * o * (1 - tcy * tcy) + gc
    go = gh * tcy * o * (1 - o)
    gi = gcy * g * i * (1 - i)
    gf = gcy * cx * f * (1 - f)
    gg = gcy * i * (1 - g * g)
    grad_gates = jnp.concatenate([gi, gf, gg, go], axis=-1)
    grad_cx = gcy * f
    grad_bias = jnp.sum(grad_gates, axis=0) if has_bias else None
    return grad_gates, grad_cx, grad_bias


@lower(aten._thnn_fused_lstm_cell_backward.default)
def _thnn_fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    gg, gcx, gb = _thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias)
    return gg, gg, gcx, gb, gb


@lower(aten._thnn_fused_gru_cell.default)
def _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, ii, in_ = jnp.split(input_gates, 3, axis=-1)
    hr, hi, hn = jnp.split(hidden_gates, 3, axis=-1)
    r = _sig(ir + hr)
    z = _sig(ii + hi)
    n = jnp.tanh(in_ + r * hn)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hn, hx], axis=-1)


@lower(aten._thnn_fused_gru_cell_backward.default)
def _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hn, hx = jnp.split(workspace, 5, axis=-1)
    gz = grad_hy * (hx - n) * z * (1 - z)
    ghx = grad_hy * z
    gn = grad_hy * (1 - z) * (1 - n * n)
    ghn = gn * r
    gr = gn * hn * r * (1 - r)
    gin = jnp.concatenate([gr, gz, gn], axis=-1)
    ghid = jnp.concatenate([gr, gz, ghn], axis=-1)
    gib = jnp.sum(gin, axis=0) if has_bias else None
    ghb = jnp.sum(ghid, axis=0) if has_bias else None
    return gin, ghid, ghx, gib, ghb


# ----------------------------------------------------------------------------- attention
# F.scaled_dot_product_attention on this device takes PyTorch's math path (sub-ops are lowered
# one by one). These lower the fused CPU overload for code that calls it explicitly.


def _attention(query, key, value, attn_mask, is_causal, scale):
    acc = _acc_dtype(query)
    q, k, v = query.astype(acc), key.astype(acc), value.astype(acc)
    if k.ndim == q.ndim and k.ndim >= 3 and k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
        rep = q.shape[-3] // k.shape[-3]
        k = jnp.repeat(k, rep, axis=-3)
        v = jnp.repeat(v, rep, axis=-3)
    L, S = q.shape[-2], k.shape[-2]
    sc = (1.0 / math.sqrt(q.shape[-1])) if scale is None else scale
    s = jnp.einsum("...le,...se->...ls", q, k, precision=lax.Precision.HIGHEST) * sc
    ninf = jnp.asarray(-jnp.inf, acc)
    if is_causal:
        s = jnp.where(jnp.tril(jnp.ones((L, S), bool)), s, ninf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            s = jnp.where(attn_mask, s, ninf)
        else:
            s = s + attn_mask.astype(acc)
    lse = jax.nn.logsumexp(s, axis=-1)
    finite = jnp.isfinite(lse)
    p = jnp.exp(s - jnp.where(finite, lse, 0)[..., None])
    p = jnp.where(finite[..., None], p, 0)
    out = jnp.einsum("...ls,...se->...le", p, v, precision=lax.Precision.HIGHEST)
    return out.astype(query.dtype), lse


def _no_dropout(op, p):
    if p:
        raise NotImplementedError(
            f"torchtpu: {op} with dropout_p={p} is not supported; call "
            "torch.nn.functional.scaled_dot_product_attention instead"
        )


@lower(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _no_dropout("_scaled_dot_product_flash_attention_for_cpu", dropout_p)
    return _attention(query, key, value, attn_mask, is_causal, scale)


@lower(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_flash_cpu_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    _no_dropout("_scaled_dot_product_flash_attention_for_cpu_backward", dropout_p)
    _, vjp = jax.vjp(lambda q, k, v: _attention(q, k, v, attn_mask, is_causal, scale)[0], query, key, value)
    return vjp(grad_out.astype(query.dtype))


@lower(aten._embedding_bag_backward.default)
def _embedding_bag_backward(*args, **kwargs):
    """The dense backward, whose arguments are these less `offsets` (offset2bag already maps
    each index to its bag) and `sparse` (sparse gradients are not supported)."""
    a = bind(aten._embedding_bag_backward.default, args, kwargs)
    if a.pop("sparse"):
        raise NotImplementedError("torchtpu: embedding_bag(sparse=True) gradients are not supported; use sparse=False")
    del a["offsets"]
    return _embedding_bag_dense_backward(**a)


# ----------------------------------------------------------------------------- fused attention
# F.scaled_dot_product_attention on tpu runs PyTorch's "overrideable" fused kernel (the slot
# PyTorch keeps for out-of-tree backends): forward and backward below. Unlike the math path,
# autograd then saves only q, k, v, the output and the log-sum-exp, not the (L, S) attention
# probabilities of every layer, and long sequences are processed in blocks of queries so that
# no (L, S) matrix is ever whole: the backward recomputes each block's scores.

_Q_BLOCK = 512  # queries per block when the sequence is long


def _rows(mask, start, size, L):
    """Rows [start, start+size) of a mask broadcastable to (..., L, S)."""
    if mask is None or mask.ndim < 2 or mask.shape[-2] != L or L == 1:
        return mask
    return lax.dynamic_slice_in_dim(mask, start, size, axis=mask.ndim - 2)


def _block_attention(q, k, v, mask, is_causal, scale, start, S):
    """Attention of a block of queries starting at row `start` against all keys."""
    acc = q.dtype
    s = jnp.einsum("...le,...se->...ls", q, k, precision=lax.Precision.HIGHEST) * scale
    ninf = jnp.asarray(-jnp.inf, acc)
    if is_causal:
        rows = start + jnp.arange(q.shape[-2])[:, None]
        s = jnp.where(jnp.arange(S)[None, :] <= rows, s, ninf)
    if mask is not None:
        s = jnp.where(mask, s, ninf) if mask.dtype == jnp.bool_ else s + mask.astype(acc)
    lse = jax.nn.logsumexp(s, axis=-1)
    finite = jnp.isfinite(lse)
    p = jnp.where(finite[..., None], jnp.exp(s - jnp.where(finite, lse, 0)[..., None]), 0)
    return jnp.einsum("...ls,...se->...le", p, v, precision=lax.Precision.HIGHEST), lse


def _prep(query, key, value, scale):
    acc = _acc_dtype(query)
    q, k, v = query.astype(acc), key.astype(acc), value.astype(acc)
    rep = 1
    if k.ndim == q.ndim and k.ndim >= 3 and k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
        rep = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, rep, axis=-3), jnp.repeat(v, rep, axis=-3)
    sc = (1.0 / math.sqrt(q.shape[-1])) if scale is None else scale
    return q, k, v, sc, rep


def _blocks(L):
    if L <= _Q_BLOCK or L % _Q_BLOCK:
        return 1, L
    return L // _Q_BLOCK, _Q_BLOCK


def _fused_forward(query, key, value, mask, is_causal, scale):
    q, k, v, sc, _ = _prep(query, key, value, scale)
    L, S = q.shape[-2], k.shape[-2]
    n, size = _blocks(L)
    if n == 1:
        out, lse = _block_attention(q, k, v, mask, is_causal, sc, 0, S)
    else:

        def one(i):
            start = i * size
            qb = lax.dynamic_slice_in_dim(q, start, size, axis=q.ndim - 2)
            return _block_attention(qb, k, v, _rows(mask, start, size, L), is_causal, sc, start, S)

        outs, lses = lax.map(one, jnp.arange(n))
        out = jnp.moveaxis(outs, 0, -3).reshape(q.shape[:-2] + (L, v.shape[-1]))
        lse = jnp.moveaxis(lses, 0, -2).reshape(q.shape[:-2] + (L,))
    return out.astype(query.dtype), lse.astype(jnp.float32)


def _fused_backward(grad_out, query, key, value, mask, is_causal, scale):
    q, k, v, sc, rep = _prep(query, key, value, scale)
    g = grad_out.astype(q.dtype)
    L, S = q.shape[-2], k.shape[-2]
    n, size = _blocks(L)

    def block_grads(start, qb, gb, mb):
        _, vjp = jax.vjp(lambda qq, kk, vv: _block_attention(qq, kk, vv, mb, is_causal, sc, start, S)[0], qb, k, v)
        return vjp(gb)

    if n == 1:
        dq, dk, dv = block_grads(0, q, g, mask)
    else:

        def step(carry, i):
            start = i * size
            qb = lax.dynamic_slice_in_dim(q, start, size, axis=q.ndim - 2)
            gb = lax.dynamic_slice_in_dim(g, start, size, axis=g.ndim - 2)
            dqb, dkb, dvb = block_grads(start, qb, gb, _rows(mask, start, size, L))
            return (carry[0] + dkb, carry[1] + dvb), dqb

        (dk, dv), dqs = lax.scan(step, (jnp.zeros_like(k), jnp.zeros_like(v)), jnp.arange(n))
        dq = jnp.moveaxis(dqs, 0, -3).reshape(q.shape)
    if rep > 1:  # grouped-query attention: fold the repeated heads back
        dk = dk.reshape(dk.shape[:-3] + (dk.shape[-3] // rep, rep) + dk.shape[-2:]).sum(-3)
        dv = dv.reshape(dv.shape[:-3] + (dv.shape[-3] // rep, rep) + dv.shape[-2:]).sum(-3)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


# On TPU the fused attention runs torchtpu's Pallas flash-attention kernels (attention_tpu.py);
# the blocked path above stays for every other platform and for what the kernels do not take
# (attention_tpu.unsupported_reason: sequence lengths off multiples of 128, query/key head dims
# below 64 or head dims above 256, other dtypes; head dims between are zero-padded to the
# kernels' sizes there). `jax.lax.platform_dependent` makes the choice when the program is lowered, for
# the platform it is compiled for (TPU topology devices included), so tracing needs no device.


def _as_4d(x):
    return x if x is None or x.ndim == 4 else x[None]


def _pallas_forward(query, key, value, mask, is_causal, scale):
    q, k, v = _as_4d(query), _as_4d(key), _as_4d(value)
    sc = (1.0 / math.sqrt(q.shape[-1])) if scale is None else scale
    out, lse = attention_tpu.attention_forward(q, k, v, mask, causal=bool(is_causal), scale=float(sc))
    if query.ndim == 3:
        out, lse = out[0], lse[0]
    return out.astype(query.dtype), lse


def _pallas_backward(grad_out, query, key, value, out, logsumexp, mask, is_causal, scale):
    q, k, v = _as_4d(query), _as_4d(key), _as_4d(value)
    sc = (1.0 / math.sqrt(q.shape[-1])) if scale is None else scale
    lse = logsumexp.reshape(q.shape[:-1])
    dq, dk, dv = attention_tpu.attention_backward(
        _as_4d(grad_out), q, k, v, _as_4d(out), lse, mask, causal=bool(is_causal), scale=float(sc)
    )
    if query.ndim == 3:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv


def _on_platform(blocked, pallas, arrays, mask, is_causal, scale, shapes_of=(0, 1, 2)):
    """`pallas` on TPU (or anywhere inside attention_tpu.interpret_kernels()), else `blocked`."""
    q, k, v = (arrays[i] for i in shapes_of)
    shapes = [x.shape if x.ndim == 4 else (1,) + x.shape for x in (q, k, v)]
    if attention_tpu.unsupported_reason(*shapes, q.dtype) is not None:
        return blocked(*arrays, mask, is_causal, scale)
    if attention_tpu.interpreting():
        return pallas(*arrays, mask, is_causal, scale)
    operands = arrays + ((mask,) if mask is not None else ())

    def branch(fn):
        def run(*ops):
            return fn(*ops[: len(arrays)], ops[len(arrays)] if mask is not None else None, is_causal, scale)

        return run

    return lax.platform_dependent(*operands, tpu=branch(pallas), default=branch(blocked))


@lower(aten._scaled_dot_product_fused_attention_overrideable.default)
def _sdpa_overrideable(
    query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    _no_dropout("_scaled_dot_product_fused_attention_overrideable", dropout_p)
    out, lse = _on_platform(_fused_forward, _pallas_forward, (query, key, value), attn_bias, is_causal, scale)
    if lse.ndim == 2:  # 3-D (H, L, E) inputs: PyTorch's meta gives (1, H, L)
        lse = lse[None]
    zero = jnp.zeros((), jnp.int64)
    empty = jnp.zeros((0,), jnp.int64)
    return out, lse, empty, empty, query.shape[-2], key.shape[-2], zero, zero, jnp.zeros((0,), query.dtype)


@lower(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def _sdpa_overrideable_backward(
    grad_out,
    query,
    key,
    value,
    attn_bias,
    grad_input_mask,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    def blocked(grad_out, query, key, value, out, logsumexp, mask, is_causal, scale):
        return _fused_backward(grad_out, query, key, value, mask, is_causal, scale)

    dq, dk, dv = _on_platform(
        blocked,
        _pallas_backward,
        (grad_out, query, key, value, out, logsumexp),
        attn_bias,
        is_causal,
        scale,
        shapes_of=(1, 2, 3),
    )
    return dq, dk, dv, None


def _sdp_choice(args, kwargs):
    """Which fused attention F.scaled_dot_product_attention uses on tpu."""
    from torch.nn.attention import SDPBackend

    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    a = dict(zip(names, args))
    a.update(kwargs)
    mask = a.get("attn_mask")
    if a.get("dropout_p", 0.0) or (mask is not None and mask.requires_grad) or a["query"].dim() not in (3, 4):
        return int(SDPBackend.MATH)  # dropout, a learned bias or odd ranks: PyTorch's math path
    return int(SDPBackend.OVERRIDEABLE)


def _matching_layout(args, out):
    """The attention output's wrapper takes the strides PyTorch's meta function gives it (the
    query's layout), so graphs traced against those strides (torch.compile) view it correctly.
    Only the wrapper's strides change: the array holds the logical values either way."""
    from ..tensor import TpuTensor, storage_of

    query, res = args[0], out[0]
    if query.dim() != 4 or res._vw:
        return out
    if tuple(query.shape) == tuple(res.shape):
        strides = query.stride()
    else:
        order = sorted(range(4), key=lambda i: query.stride()[i], reverse=True)
        strides, acc = [0] * 4, 1
        for i in reversed(order):
            strides[i] = acc
            acc *= res.shape[i]
    if tuple(strides) == tuple(res.stride()):
        return out
    fixed = TpuTensor(storage_of(res), (), tuple(res.shape), res.dtype, strides=tuple(strides))
    return (fixed,) + tuple(out[1:])


def _grads_like_inputs(args, out):
    """Attention gradients take their inputs' strides (PyTorch's meta: empty_like)."""
    from ..tensor import TpuTensor, storage_of

    fixed = list(out)
    for i, src in zip(range(3), args[1:4]):
        g = out[i]
        if isinstance(g, TpuTensor) and not g._vw and tuple(g.shape) == tuple(src.shape) and g.stride() != src.stride():
            fixed[i] = TpuTensor(storage_of(g), (), tuple(g.shape), g.dtype, strides=tuple(src.stride()))
    return tuple(fixed)


_SDPA_LIB = None


def _sdpa_autograd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention for tpu tensors (PyTorch's choice of fused kernel is a
    C++ dispatch stub that out-of-tree Python backends cannot fill, so the op itself is
    registered for the tpu autograd key)."""
    import torch
    from torch.nn.attention import SDPBackend

    # under torch.func (vmap, jvp, ...) the math path, which is composite: functorch has no batching
    # or forward-mode rule for the fused kernel
    math_path = torch._C._are_functorch_transforms_active()
    if math_path or _sdp_choice((query, key, value, attn_mask, dropout_p, is_causal), {}) == int(SDPBackend.MATH):
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]
    return torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        query, key, value, attn_mask, dropout_p, is_causal, False, scale=scale
    )[0]


def _register_sdpa():
    import torch

    global _SDPA_LIB
    _SDPA_LIB = torch.library.Library("aten", "IMPL")
    _SDPA_LIB.impl("scaled_dot_product_attention", _sdpa_autograd, "AutogradPrivateUse1")
    POST[aten._scaled_dot_product_fused_attention_overrideable.default] = _matching_layout
    POST[aten._scaled_dot_product_fused_attention_overrideable_backward.default] = _grads_like_inputs


_register_sdpa()


# ----------------------------------------------------------------------------- packed sequences
# pack_padded_sequence's lengths are a CPU tensor (ATen requires it), and so is the packed
# sequence's batch_sizes, as on CUDA: the layout is known on the host and the data moves with one
# gather (forward) or one scatter (backward) on the device.


def _packed_rows(batch_sizes, batch):
    # row of each packed element in the time-major (T * B, ...) view of the padded input
    return [t * batch + b for t, n in enumerate(batch_sizes) for b in range(n)]


@custom(aten._pack_padded_sequence.default)
def pack_padded_sequence(args, kwargs):
    import torch

    a = bind(aten._pack_padded_sequence.default, args, kwargs)
    x, lengths = a["input"], a["lengths"]
    if lengths.device.type != "cpu" or lengths.dim() != 1:
        raise RuntimeError(
            f"pack_padded_sequence: 'lengths' must be a 1-D CPU int64 tensor, got {lengths.dim()}-D on {lengths.device}"
        )
    if a["batch_first"]:
        x = x.transpose(0, 1)
    steps, batch = x.shape[0], x.shape[1]
    lengths = [int(n) for n in lengths.tolist()]
    if len(lengths) != batch:
        raise RuntimeError(f"pack_padded_sequence: expected {batch} lengths (the batch size), got {len(lengths)}")
    if any(n <= 0 for n in lengths):
        raise RuntimeError("pack_padded_sequence: every sequence length must be greater than 0")
    if any(p < n for p, n in zip(lengths, lengths[1:])):
        raise RuntimeError(
            "pack_padded_sequence: `lengths` must be sorted in decreasing order; pass enforce_sorted=False "
            "to pack unsorted sequences"
        )
    if lengths[0] > steps:
        raise RuntimeError(f"pack_padded_sequence: a length of {lengths[0]} exceeds the {steps} padded steps")
    batch_sizes = [sum(1 for n in lengths if n > t) for t in range(lengths[0])]
    rows = torch.tensor(_packed_rows(batch_sizes, batch), device=x.device)
    data = x.reshape(steps * batch, *x.shape[2:]).index_select(0, rows)
    return data, torch.tensor(batch_sizes, dtype=torch.int64)


@custom(aten._pack_padded_sequence_backward.default)
def pack_padded_sequence_backward(args, kwargs):
    import torch

    a = bind(aten._pack_padded_sequence_backward.default, args, kwargs)
    grad, sizes, batch_first = a["grad"], [int(s) for s in a["input_size"]], a["batch_first"]
    if batch_first:
        sizes[0], sizes[1] = sizes[1], sizes[0]
    batch_sizes = [int(n) for n in a["batch_sizes"].tolist()]
    rows = torch.tensor(_packed_rows(batch_sizes, sizes[1]), device=grad.device)
    out = grad.new_zeros((sizes[0] * sizes[1], *sizes[2:])).index_copy(0, rows, grad).reshape(sizes)
    return out.transpose(0, 1) if batch_first else out
