"""The long tail: ops that belong to no other family.

- equal / allclose: answer a Python bool (a device-to-host read, like on any accelerator);
- hash_tensor: xor of the 64-bit patterns of the values;
- histogram / histogramdd: counts through a segment sum, edges like PyTorch's linspace;
- segment_reduce and its backward: segment ids from `lengths`/`offsets`, then segment ops;
- bincount: its length is the largest value + 1, read from the concrete input (eager only);
- GradScaler's two kernels: unscale with an inf/NaN check, and the loss-scale update.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..registry import CUSTOM, array_of, aten, custom, lower
from ..tensor import TpuTensor

# ----------------------------------------------------------------------------- comparisons


def _array(x):
    if isinstance(x, TpuTensor):
        return array_of(x)
    from .. import dtypes

    return jnp.asarray(dtypes.torch_to_numpy(x))


@jax.jit
def _equal_fn(a, b):
    return jnp.array_equal(a, b)


@custom(aten.equal.default)
def equal(args, kwargs):
    self, other = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if tuple(self.shape) != tuple(other.shape):
        return False
    a, b = _array(self), _array(other)
    if a.size == 0:
        return True
    return bool(_equal_fn(a, b))


def _isclose(a, b, rtol, atol, equal_nan):
    dt = jnp.result_type(a, b)
    if not jnp.issubdtype(dt, jnp.inexact):
        dt = jnp.float32
    a, b = a.astype(dt), b.astype(dt)
    close = a == b
    finite = jnp.isfinite(a) & jnp.isfinite(b)
    diff = jnp.abs(a - b)
    close = close | (finite & (diff <= atol + rtol * jnp.abs(b)))
    if equal_nan:
        close = close | (jnp.isnan(a) & jnp.isnan(b))
    return jnp.all(close)


_ALLCLOSE = jax.jit(_isclose, static_argnums=(4,))


@custom(aten.allclose.default)
def allclose(args, kwargs):
    names = ("self", "other", "rtol", "atol", "equal_nan")
    defaults = {"rtol": 1e-05, "atol": 1e-08, "equal_nan": False}
    values = dict(defaults)
    values.update(zip(names, args))
    values.update(kwargs)
    a, b = _array(values["self"]), _array(values["other"])
    if a.dtype != b.dtype:
        raise RuntimeError(
            f"allclose: self ({a.dtype}) and other ({b.dtype}) must have the same dtype; convert one first"
        )
    try:
        jnp.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise RuntimeError(f"allclose: shapes {tuple(a.shape)} and {tuple(b.shape)} do not broadcast") from None
    if a.size == 0 or b.size == 0:
        return True
    return bool(_ALLCLOSE(a, b, float(values["rtol"]), float(values["atol"]), bool(values["equal_nan"])))


# ----------------------------------------------------------------------------- hash_tensor


def _dims(dim, ndim):
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(ndim))
    return tuple(sorted(d + ndim if d < 0 else d for d in dim)) if ndim else ()


@lower(aten.hash_tensor.default)
def hash_tensor(self, dim=(), keepdim=False, mode=0):
    if mode != 0:
        raise NotImplementedError(f"torchtpu: hash_tensor mode={mode} is not supported; use mode=0 (xor_sum)")
    if jnp.issubdtype(self.dtype, jnp.floating):
        bits = lax.bitcast_convert_type(self.astype(jnp.float64), jnp.uint64)
    else:
        bits = self.astype(jnp.int64).astype(jnp.uint64)
    dims = _dims(dim, self.ndim)
    out = lax.reduce(bits, np.uint64(0), lax.bitwise_xor, dims) if dims else bits
    if keepdim:
        out = jnp.expand_dims(out, dims) if dims else out
    return out


# ----------------------------------------------------------------------------- histograms


def _linspace(start, end, steps, dtype):
    """PyTorch's CPU linspace: from the start for the first half, from the end for the rest."""
    start = jnp.asarray(start, dtype)
    end = jnp.asarray(end, dtype)
    if steps == 1:
        return start[None]
    step = (end - start) / jnp.asarray(steps - 1, dtype)
    i = jnp.arange(steps)
    half = steps // 2
    lo = start + step * i.astype(dtype)
    hi = end - step * (steps - 1 - i).astype(dtype)
    return jnp.where(i < half, lo, hi)


def _outer_edges(x, ranges, ndims):
    """Leftmost and rightmost edges per dimension of `x` (N, D), as PyTorch chooses them."""
    if ranges is not None:
        ranges = list(ranges)
        if len(ranges) != 2 * ndims:
            raise RuntimeError(f"histogramdd: range should have {2 * ndims} elements, but got {len(ranges)}")
        lo = jnp.asarray(ranges[0::2], jnp.float64 if x.dtype == jnp.float64 else jnp.float32)
        hi = jnp.asarray(ranges[1::2], lo.dtype)
        for a, b in zip(ranges[0::2], ranges[1::2]):
            if a > b:
                raise RuntimeError(f"histogramdd: min should not exceed max, but got min {a} max {b}")
            if not (math.isfinite(a) and math.isfinite(b)):
                raise RuntimeError(f"histogramdd: range of [{a}, {b}] is not finite")
    elif x.shape[0] == 0:
        lo = jnp.zeros((ndims,), x.dtype)
        hi = jnp.ones((ndims,), x.dtype)
    else:
        lo = jnp.min(x, axis=0)
        hi = jnp.max(x, axis=0)
    lo = lo.astype(x.dtype)
    hi = hi.astype(x.dtype)
    same = lo == hi
    lo = jnp.where(same, lo - 0.5, lo)
    hi = jnp.where(same, hi + 0.5, hi)
    return lo, hi


def _bin_edges(x, bins, ranges):
    ndims = x.shape[-1]
    lo, hi = _outer_edges(x, ranges, ndims)
    return [_linspace(lo[d], hi[d], bins[d] + 1, x.dtype) for d in range(ndims)]


def _hist_from_edges(x, edges, weight, density):
    """Counts (or weight sums) of `x` (N, D) in the bins between `edges` (D arrays)."""
    nbins = [e.shape[0] - 1 for e in edges]
    valid = jnp.ones(x.shape[:1], bool)
    flat = jnp.zeros(x.shape[:1], jnp.int64)
    for d, e in enumerate(edges):
        v = x[:, d]
        pos = jnp.searchsorted(e, v, side="right") - 1
        pos = jnp.where(v == e[-1], nbins[d] - 1, pos)  # the last bin includes its right edge
        valid = valid & (v >= e[0]) & (v <= e[-1]) & (nbins[d] > 0)
        flat = flat * nbins[d] + jnp.clip(pos, 0, max(nbins[d] - 1, 0))
    w = jnp.ones(x.shape[:1], x.dtype) if weight is None else weight.reshape(-1).astype(x.dtype)
    total_bins = math.prod(nbins)
    hist = jnp.zeros((total_bins,), x.dtype).at[jnp.where(valid, flat, total_bins)].add(w, mode="drop")
    hist = hist.reshape(nbins)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            width = (e[1:] - e[:-1]).astype(x.dtype)
            shape = [1] * len(nbins)
            shape[d] = nbins[d]
            hist = hist / width.reshape(shape)
    return hist


def _as_points(self):
    """histogramdd's input (..., D) as (N, D); histogram's 1-D view of any input."""
    return self.reshape(-1, self.shape[-1]) if self.ndim else self.reshape(1, 1)


@lower(aten.histogram.bin_ct)
def histogram_bin_ct(self, bins=100, range=None, weight=None, density=False):
    if bins <= 0:
        raise RuntimeError(f"histogram(): bins must be > 0, but got {bins}")
    x = self.reshape(-1, 1)
    edges = _bin_edges(x, [bins], range)
    w = None if weight is None else weight.reshape(-1)
    return _hist_from_edges(x, edges, w, density), edges[0]


@lower(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, weight=None, density=False):
    x = self.reshape(-1, 1)
    edges = [bins.astype(self.dtype)]
    w = None if weight is None else weight.reshape(-1)
    return _hist_from_edges(x, edges, w, density), edges[0]


@lower(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(self, bins, range=None, weight=None, density=False):
    x = _as_points(self)
    return _bin_edges(x, list(bins), range)


@lower(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(self, bins, range=None, weight=None, density=False):
    x = _as_points(self)
    edges = _bin_edges(x, list(bins), range)
    return _hist_from_edges(x, edges, weight, density)


@lower(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(self, bins, weight=None, density=False):
    x = _as_points(self)
    return _hist_from_edges(x, [b.astype(self.dtype) for b in bins], weight, density)


# ----------------------------------------------------------------------------- segment_reduce


def _segment_ids(lengths, offsets, axis_len):
    """Segment id of each position along the reduced axis, per row: (R, L) ids in [0, S],
    S meaning "in no segment"; and the segment lengths (R, S)."""
    if offsets is None:
        lengths = lengths.astype(jnp.int64)
        ends = jnp.cumsum(lengths, axis=-1)
        starts0 = jnp.zeros(lengths.shape[:-1] + (1,), jnp.int64)
    else:
        offsets = offsets.astype(jnp.int64)
        ends = offsets[..., 1:]
        starts0 = offsets[..., :1]
        lengths = ends - offsets[..., :-1]
    nseg = lengths.shape[-1]
    rows = math.prod(lengths.shape[:-1])
    ends = ends.reshape(rows, nseg)
    starts0 = starts0.reshape(rows, 1)
    pos = jnp.arange(axis_len, dtype=jnp.int64)
    ids = jnp.sum(pos[None, :, None] >= ends[:, None, :], axis=-1)  # (R, L)
    ids = jnp.where(pos[None, :] < starts0, nseg, ids)
    return ids, lengths.reshape(rows, nseg), nseg, rows


def _segment_layout(data, lengths, offsets, axis):
    axis = axis + data.ndim if axis < 0 else axis
    outer = data.shape[:axis]
    inner = data.shape[axis + 1 :]
    L = data.shape[axis]
    ids, lens, nseg, rows = _segment_ids(lengths, offsets, L)
    if rows != math.prod(outer):
        raise RuntimeError(
            f"segment_reduce: lengths/offsets must have the shape of data's dims before axis {axis}, plus one"
        )
    flat_ids = (ids + jnp.arange(rows, dtype=jnp.int64)[:, None] * (nseg + 1)).reshape(-1)
    return axis, outer, inner, L, flat_ids, lens, nseg, rows


def _segment_forward(data, reduce, lengths, offsets, axis, initial):
    axis, outer, inner, L, flat_ids, lens, nseg, rows = _segment_layout(data, lengths, offsets, axis)
    x = data.reshape((rows * L,) + inner)
    num = rows * (nseg + 1)
    if reduce in ("sum", "mean"):
        r = jax.ops.segment_sum(x, flat_ids, num)
    elif reduce == "prod":
        r = jax.ops.segment_prod(x, flat_ids, num)
    elif reduce == "max":
        r = jax.ops.segment_max(x, flat_ids, num)
    elif reduce == "min":
        r = jax.ops.segment_min(x, flat_ids, num)
    else:
        raise RuntimeError(f"segment_reduce: reduce '{reduce}' is not one of sum, mean, prod, max, min")
    r = r.reshape((rows, nseg + 1) + inner)[:, :nseg]
    counts = lens.reshape((rows, nseg) + (1,) * len(inner)).astype(data.dtype)
    if reduce == "sum":
        out = r if initial is None else r + initial
    elif reduce == "prod":
        out = r if initial is None else r * initial
    elif reduce == "max":
        empty = jnp.asarray(-jnp.inf, data.dtype)
        r = jnp.where(counts > 0, r, empty)
        out = r if initial is None else jnp.maximum(r, jnp.asarray(initial, data.dtype))
    elif reduce == "min":
        empty = jnp.asarray(jnp.inf, data.dtype)
        r = jnp.where(counts > 0, r, empty)
        out = r if initial is None else jnp.minimum(r, jnp.asarray(initial, data.dtype))
    else:  # mean
        if initial is None:
            out = r / counts
        else:
            out = jnp.where(counts > 0, (r + initial) / jnp.maximum(counts, 1), jnp.asarray(initial, data.dtype))
    out = out.astype(data.dtype)
    return out.reshape(outer + (nseg,) + inner)


@lower(aten.segment_reduce.default)
def segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    if indices is not None:
        raise NotImplementedError("segment_reduce: `indices` is not supported (as on CPU); pass lengths or offsets")
    if lengths is None and offsets is None:
        raise RuntimeError("segment_reduce: pass one of lengths or offsets")
    return _segment_forward(data, reduce, lengths, offsets, axis, initial)


@lower(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, lengths=None, offsets=None, axis=0, initial=None):
    _, outer, inner, L, flat_ids, lens, nseg, rows = _segment_layout(data, lengths, offsets, axis)
    shape2 = (rows, nseg) + inner

    def gather(v):  # (R, S, *inner) -> value of each data position's segment, 0 outside segments
        v = v.reshape(shape2)
        v = jnp.concatenate([v, jnp.zeros((rows, 1) + inner, v.dtype)], axis=1)
        return v.reshape((rows * (nseg + 1),) + inner)[flat_ids]

    num = rows * (nseg + 1)
    x = data.reshape((rows * L,) + inner)
    g = gather(grad)
    if reduce == "sum":
        gi = g
    elif reduce == "mean":
        counts = lens.reshape((rows, nseg) + (1,) * len(inner)).astype(data.dtype)
        gi = gather(grad / jnp.maximum(counts, 1))
    elif reduce in ("max", "min"):
        hit = (x == gather(output)).astype(data.dtype)
        n = jax.ops.segment_sum(hit, flat_ids, num).reshape((rows, nseg + 1) + inner)[:, :nseg]
        gi = hit * gather(grad / jnp.maximum(n, 1))
    elif reduce == "prod":
        zero = x == 0
        nonzero_prod = jax.ops.segment_prod(jnp.where(zero, 1, x), flat_ids, num)
        nonzero_prod = nonzero_prod.reshape((rows, nseg + 1) + inner)[:, :nseg]
        if initial is not None:
            nonzero_prod = nonzero_prod * initial
        zeros = jax.ops.segment_sum(zero.astype(jnp.int32), flat_ids, num).reshape((rows, nseg + 1) + inner)[:, :nseg]
        g_zero = g * jnp.where(gather(zeros) == 1, gather(nonzero_prod), 0)
        g_nonzero = g * gather(output) / jnp.where(zero, 1, x)
        gi = jnp.where(zero, g_zero, g_nonzero)
    else:
        raise RuntimeError(f"segment_reduce: reduce '{reduce}' is not one of sum, mean, prod, max, min")
    return gi.astype(data.dtype).reshape(data.shape)


# ----------------------------------------------------------------------------- renorm


@lower(aten.renorm.default, static=("p",))
def renorm(self, p, dim, maxnorm):
    dim = dim + self.ndim if dim < 0 else dim
    if self.ndim == 0:
        raise RuntimeError("renorm: input needs at least 1 dimension, got 0 dimensions")
    x = self.astype(jnp.promote_types(self.dtype, jnp.float32))
    axes = tuple(d for d in range(x.ndim) if d != dim)
    a = jnp.abs(x)
    if isinstance(p, (int, float)) and p == float("inf"):
        norm = jnp.max(a, axis=axes, keepdims=True, initial=0)
    elif isinstance(p, (int, float)) and p == float("-inf"):
        norm = jnp.min(a, axis=axes, keepdims=True, initial=jnp.inf)
    elif isinstance(p, (int, float)) and p == 0:
        norm = jnp.sum(a != 0, axis=axes, keepdims=True).astype(x.dtype)
    elif isinstance(p, (int, float)) and p == 1:
        norm = jnp.sum(a, axis=axes, keepdims=True)
    elif isinstance(p, (int, float)) and p == 2:
        norm = jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=True))
    else:
        norm = jnp.sum(a**p, axis=axes, keepdims=True) ** (1.0 / p)
    factor = jnp.where(norm > maxnorm, maxnorm / (norm + 1e-7), 1.0).astype(x.dtype)
    return (x * factor).astype(self.dtype)


# ----------------------------------------------------------------------------- resize_as_


@custom(aten.resize_as_.default)
def resize_as_(args, kwargs):
    template = args[1] if len(args) > 1 else kwargs["the_template"]
    return CUSTOM[aten.resize_.default]((args[0], list(template.shape)), {})


# ----------------------------------------------------------------------------- copy (functional)


@lower(aten.copy.default)
def copy(self, src, non_blocking=False):
    """The functional copy_: `src` broadcast to `self`'s shape, in `self`'s dtype."""
    if jnp.iscomplexobj(src) and not jnp.iscomplexobj(self):
        src = jnp.real(src)
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


@lower(aten._foreach_copy.default)
def foreach_copy(self, src, non_blocking=False):
    """The functional _foreach_copy_ (FSDP2's copy into its all-gather buffer)."""
    return [copy(d, s) for d, s in zip(self, src)]


# ----------------------------------------------------------------------------- bincount


@lower(aten.bincount.default, jit=False)
def bincount(self, weights=None, minlength=0):
    if isinstance(self, jax.core.Tracer):
        raise NotImplementedError(
            "torchtpu: bincount's output length depends on the largest input value, so it cannot be part "
            "of a compiled program; call it outside, or count with a fixed length "
            "(torch.zeros(n).index_add_(0, x, ones) or scatter_add_)"
        )
    length = max(int(minlength), int(np.asarray(self).max()) + 1 if self.size else 0)
    if weights is None:
        return jnp.zeros(length, jnp.int64).at[self].add(1)
    # PyTorch sums float32 weights in float32 and every other weight dtype in float64
    dtype = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64
    return jnp.zeros(length, dtype).at[self].add(weights.astype(dtype))


# ----------------------------------------------------------------------------- GradScaler


@lower(aten._amp_foreach_non_finite_check_and_unscale.default)
def amp_foreach_non_finite_check_and_unscale(self, found_inf, inv_scale):
    # found_inf becomes 1 when any gradient holds an inf or NaN; each gradient is multiplied by
    # inv_scale in its own dtype, as ATen's kernel does
    bad = found_inf
    scaled = []
    for g in self:
        bad = jnp.maximum(bad, jnp.any(~jnp.isfinite(g)).astype(found_inf.dtype))
        scaled.append((g * inv_scale.astype(jnp.float32)).astype(g.dtype))
    return scaled, bad


@lower(aten._amp_update_scale.default)
def amp_update_scale(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    # ATen's rule: back off and reset the tracker after an overflow; otherwise grow the scale
    # (if the grown scale is finite) once `growth_interval` steps in a row were finite
    inf = found_inf.reshape(()) > 0
    grown = growth_tracker + 1
    grow = grown == growth_interval
    bigger = self * scale_growth_factor
    scale = jnp.where(inf, self * scale_backoff_factor, jnp.where(grow & jnp.isfinite(bigger), bigger, self))
    tracker = jnp.where(inf | grow, jnp.zeros_like(growth_tracker), grown)
    return scale.astype(self.dtype), tracker.astype(growth_tracker.dtype)
