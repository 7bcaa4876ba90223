"""Indexing, gathering and scattering ops.

Advanced indexing follows NumPy's rules, which are PyTorch's: an `indices` list holds one
entry per leading dimension of `self` (None for "take the whole dimension"); when the
indexed dimensions are adjacent the broadcast index shape replaces them in place, otherwise
it moves to the front. JAX's own `x[...]` implements exactly those rules, so the lowerings
translate `indices` into a NumPy-style index tuple.

Boolean masks select a data-dependent number of elements. `index.Tensor` therefore runs
eagerly (jit=False) and turns a mask into integer positions with `nonzero` on the concrete
mask; the integer work itself still runs as one cached XLA executable. `index_put` with a
mask keeps a static shape and works in compiled programs too (see `_mask_put`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..registry import CONFIG, aten, lower


def _dim(d, ndim):
    return d + ndim if d < 0 else d


def _is_bool(a):
    return a is not None and (a.dtype == jnp.bool_ or a.dtype == jnp.uint8)


def _concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _expand_masks(indices):
    """Replace boolean masks by the integer index arrays of their True positions."""
    out = []
    for ix in indices:
        if _is_bool(ix):
            if not _concrete(ix):
                raise NotImplementedError(
                    "torchtpu: indexing with a boolean mask gives a data-dependent shape and cannot be "
                    "part of a compiled program; use torch.where(mask, x, other) or masked_fill instead, "
                    "or index outside the compiled region"
                )
            m = np.asarray(ix).astype(bool)
            out.extend(jnp.asarray(p) for p in np.nonzero(m))
        else:
            out.append(ix)
    return out


def narrow_index(ix, shape):
    """Integer indices into an array of `shape` as int32 when every dimension is under 2**31
    (same positions): XLA's TPU cost model gives no time for a gather or scatter with 64-bit
    indices (PyTorch's indices are int64), and TPUs emulate 64-bit integers."""
    if getattr(ix, "dtype", None) == jnp.int64 and all(n < 2**31 for n in shape):
        return ix.astype(jnp.int32)
    return ix


def _index_tuple(indices, shape=None):
    if shape is None:
        return tuple(slice(None) if ix is None else ix for ix in indices)
    return tuple(slice(None) if ix is None else narrow_index(ix, shape) for ix in indices)


def _index_fn(self, indices):
    return self[_index_tuple(indices, self.shape)]


_INDEX_JIT = jax.jit(_index_fn)


def _check_bounds(self, indices):
    # Reading the indices back to the host would stall the asynchronous pipeline on every
    # x[idx], so bounds are checked in debug mode only (TORCHTPU_DEBUG=1); otherwise XLA
    # clamps out-of-range gathers and drops out-of-range scatters.
    if not CONFIG.debug or any(not _concrete(ix) for ix in indices if ix is not None):
        return
    for d, ix in enumerate(indices):
        if ix is None or ix.size == 0:
            continue
        n = self.shape[d]
        a = np.asarray(ix)
        lo, hi = int(a.min()), int(a.max())
        if hi >= n or lo < -n:
            bad = hi if hi >= n else lo
            raise IndexError(f"index {bad} is out of bounds for dimension {d} with size {n}")


@lower(aten.index.Tensor, jit=False)
def index(self, indices):
    indices = _expand_masks(list(indices))
    if len(indices) > self.ndim:
        raise IndexError(f"too many indices for tensor of dimension {self.ndim} (got {len(indices)})")
    _check_bounds(self, indices)
    indices = [
        None if ix is None else ix.astype(jnp.int64) if ix.dtype not in (jnp.int32, jnp.int64) else ix for ix in indices
    ]
    if all(_concrete(ix) for ix in indices if ix is not None) and _concrete(self):
        return _INDEX_JIT(self, indices)
    return _index_fn(self, indices)


@lower(aten._unsafe_index.Tensor)
def _unsafe_index(self, indices):
    return self[_index_tuple(list(indices))]


def _broadcast_values(values, target_shape, dtype):
    return jnp.broadcast_to(values.astype(dtype), target_shape)


def _int_put(self, indices, values, accumulate):
    idx = _index_tuple(indices, self.shape)
    target = jax.eval_shape(lambda s: s[idx], jax.ShapeDtypeStruct(self.shape, self.dtype)).shape
    values = _broadcast_values(values, target, self.dtype)
    if accumulate:
        if self.dtype == jnp.bool_:
            return self.at[idx].max(values)
        return self.at[idx].add(values)
    return self.at[idx].set(values)


_INT_PUT_JIT = jax.jit(_int_put, static_argnums=(3,))


def _mask_put(self, mask, values, accumulate):
    """`self[mask] = values` with `mask` covering self's leading dims; static shapes only.

    values broadcasts against (nnz, *rest). The k-th True position of the mask (row-major)
    takes row k of values, found with a cumulative sum instead of nonzero.
    """
    k = mask.ndim
    rest = self.shape[k:]
    mask = mask.astype(jnp.bool_)
    if values.ndim > len(rest) and values.shape[values.ndim - len(rest) - 1] != 1:
        vals = (
            values.reshape((-1,) + rest)
            if values.ndim == len(rest) + 1
            else jnp.broadcast_to(
                values, values.shape[: values.ndim - len(rest) - 1] + values.shape[values.ndim - len(rest) - 1 :]
            ).reshape((-1,) + rest)
        )
        vals = jnp.broadcast_to(vals, (vals.shape[0],) + rest)
        pos = jnp.cumsum(mask.reshape(-1).astype(jnp.int32)) - 1
        pos = jnp.clip(pos, 0, max(vals.shape[0] - 1, 0))
        if vals.shape[0] == 0:
            gathered = jnp.zeros((mask.size,) + rest, self.dtype)
        else:
            gathered = vals[pos].astype(self.dtype)
        gathered = gathered.reshape(self.shape)
    else:
        v = values.reshape(values.shape[values.ndim - len(rest) :]) if values.ndim > len(rest) else values
        gathered = jnp.broadcast_to(v.astype(self.dtype), self.shape)
    m = mask.reshape(mask.shape + (1,) * len(rest))
    if accumulate:
        if self.dtype == jnp.bool_:
            return self | (m & gathered)
        return self + jnp.where(m, gathered, jnp.zeros((), self.dtype))
    return jnp.where(m, gathered, self)


def index_put_impl(self, indices, values, accumulate=False):
    indices = list(indices)
    while indices and indices[-1] is None:
        indices.pop()
    if not indices:
        values = jnp.broadcast_to(values.astype(self.dtype), self.shape)
        return self + values if accumulate else values
    bools = [i for i, ix in enumerate(indices) if _is_bool(ix)]
    if bools and (len(indices) == 1 or all(ix is None for ix in indices[1:])) and bools == [0] and indices[0].ndim >= 1:
        mask = indices[0]
        if mask.shape == self.shape[: mask.ndim] and (
            not _concrete(mask)
            or values.ndim == 0
            or values.size == 1
            or not _concrete(values)
            or values.ndim <= self.ndim - mask.ndim
        ):
            return _mask_put(self, mask, values, accumulate)
    indices = _expand_masks(indices)
    if len(indices) > self.ndim:
        raise IndexError(f"too many indices for tensor of dimension {self.ndim} (got {len(indices)})")
    _check_bounds(self, indices)
    if all(_concrete(ix) for ix in indices if ix is not None) and _concrete(self) and _concrete(values):
        return _INT_PUT_JIT(self, indices, values, bool(accumulate))
    return _int_put(self, indices, values, bool(accumulate))


@lower(aten.index_put.default, aten._index_put_impl.default, jit=False)
def index_put(self, indices, values, accumulate=False, unsafe=False):
    return index_put_impl(self, indices, values, accumulate)


@lower(aten._unsafe_index_put.default)
def _unsafe_index_put(self, indices, values, accumulate=False):
    return _int_put(self, list(indices), values, bool(accumulate))


@lower(aten._unsafe_masked_index.default)
def _unsafe_masked_index(self, mask, indices, fill):
    idx = [None if ix is None else jnp.where(mask, ix, jnp.zeros((), ix.dtype)) for ix in indices]
    got = self[_index_tuple(idx)]
    return jnp.where(mask, got, jnp.asarray(fill).astype(self.dtype))


@lower(aten._unsafe_masked_index_put_accumulate.default)
def _unsafe_masked_index_put_accumulate(self, mask, indices, values):
    idx = [None if ix is None else jnp.where(mask, ix, jnp.zeros((), ix.dtype)) for ix in indices]
    vals = jnp.where(mask, values, jnp.zeros((), values.dtype))
    return _int_put(self, idx, vals, True)


# ----------------------------------------------------------------------------- gather / scatter


def _full_index(index, dim, shape=None):
    """Index tuple addressing, for every element of `index`, position index[...] along `dim` (of an
    array of `shape`, when given: then int32 where it fits, see narrow_index)."""
    if shape is not None:
        index = narrow_index(index, tuple(shape) + tuple(index.shape))
    idx = []
    for d in range(index.ndim):
        if d == dim:
            idx.append(index)
        else:
            shape = [1] * index.ndim
            shape[d] = index.shape[d]
            idx.append(lax.broadcasted_iota(jnp.int64 if index.dtype == jnp.int64 else jnp.int32, tuple(shape), d))
    return tuple(idx)


def _fit(src, shape):
    """src sliced down to `shape` (scatter/gather use only the leading part of src)."""
    if src.shape == tuple(shape):
        return src
    return src[tuple(slice(0, n) for n in shape)]


@lower(aten.gather.default)
def gather(self, dim, index, sparse_grad=False):
    if self.ndim == 0:
        return jnp.broadcast_to(self, index.shape) if index.ndim == 0 else self.reshape(1)[index]
    dim = _dim(dim, self.ndim)
    if index.ndim == 0:
        index = index.reshape(1)
        return self.reshape(-1)[index].reshape(())
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    return self[_full_index(index, dim, self.shape)]


def _prep_scatter(self, dim, index, src):
    if self.ndim == 0:
        return None
    dim = _dim(dim, self.ndim)
    if index.ndim == 0:
        index = index.reshape(1)
    if not hasattr(src, "shape") or jnp.ndim(src) == 0:
        src = jnp.broadcast_to(jnp.asarray(src), index.shape)
    else:
        if src.ndim == 0:
            src = src.reshape(1)
        src = _fit(src, index.shape)
    return dim, index, src.astype(self.dtype)


def _scatter_0d(self, index, src, reduce):
    src = jnp.asarray(src).reshape(-1)
    if index.size == 0:
        return self
    s = src[0].astype(self.dtype)
    if reduce in (None, "none"):
        return s
    if reduce in ("add", "sum"):
        return self + jnp.sum(src[: index.size]).astype(self.dtype)
    if reduce in ("multiply", "prod"):
        return self * jnp.prod(src[: index.size]).astype(self.dtype)
    raise NotImplementedError(f"torchtpu: scatter reduce={reduce!r} on a 0-dim tensor is not supported")


@lower(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce)
def scatter(self, dim, index, src=None, value=None, reduce=None):
    if src is None:
        src = value
    if self.ndim == 0:
        return _scatter_0d(self, index, src, reduce)
    if index.size == 0:
        return self
    dim, index, src = _prep_scatter(self, dim, index, src)
    at = self.at[_full_index(index, dim, self.shape)]
    if reduce is None:
        return at.set(src)
    if reduce == "add":
        return at.add(src) if self.dtype != jnp.bool_ else at.max(src)
    if reduce == "multiply":
        return at.multiply(src) if self.dtype != jnp.bool_ else at.min(src)
    raise RuntimeError(f"torchtpu: scatter reduce argument must be 'add' or 'multiply', got {reduce!r}")


# A scatter-add along a short dimension (gather's gradient, such as a Mixture-of-Experts router's
# top-k scores) adds with compares and sums instead: XLA's TPU cost model gives no time for a
# program holding a scatter-add of scalars. Used when every other dimension of the index is whole
# and index length x dimension length is at most this.
_DENSE_SCATTER_ADD = 8192


def _dense_scatter_add_fits(self, dim, index) -> bool:
    others = all(index.shape[d] == self.shape[d] for d in range(self.ndim) if d != dim)
    return (
        self.dtype != jnp.bool_
        and index.ndim == self.ndim
        and others
        and index.shape[dim] * self.shape[dim] <= _DENSE_SCATTER_ADD
    )


def _dense_scatter_add(self, dim, index, src):
    """self.scatter_add(dim, index, src) as sum_j (index[.., j, ..] == e) * src[.., j, ..]."""
    idx = jnp.moveaxis(index, dim, -1)
    values = jnp.moveaxis(src, dim, -1)
    hit = idx[..., :, None] == jnp.arange(self.shape[dim], dtype=idx.dtype)
    added = jnp.sum(jnp.where(hit, values[..., :, None], jnp.zeros((), values.dtype)), axis=-2)
    return self + jnp.moveaxis(added, -1, dim).astype(self.dtype)


@lower(aten.scatter_add.default)
def scatter_add(self, dim, index, src):
    if self.ndim == 0:
        return _scatter_0d(self, index, src, "add")
    if index.size == 0:
        return self
    dim, index, src = _prep_scatter(self, dim, index, src)
    if _dense_scatter_add_fits(self, dim, index):
        return _dense_scatter_add(self, dim, index, src)
    idx = _full_index(index, dim, self.shape)
    if self.dtype == jnp.bool_:
        return self.at[idx].max(src)
    return self.at[idx].add(src)


def _identity(reduce, dtype):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if reduce == "amax":
        return (
            jnp.array(-jnp.inf, dtype)
            if jnp.issubdtype(dtype, jnp.floating)
            else jnp.array(jnp.iinfo(dtype).min if dtype != jnp.bool_ else False, dtype)
        )
    if reduce == "amin":
        return (
            jnp.array(jnp.inf, dtype)
            if jnp.issubdtype(dtype, jnp.floating)
            else jnp.array(jnp.iinfo(dtype).max if dtype != jnp.bool_ else True, dtype)
        )
    raise RuntimeError(f"torchtpu: reduce argument must be one of sum, prod, mean, amax, amin; got {reduce!r}")


def _reduce_into(self, idx, src, reduce, include_self):
    """self with src reduced into positions idx (an index tuple), scatter_reduce semantics."""
    dtype = self.dtype
    touched = jnp.zeros(self.shape, jnp.bool_).at[idx].set(True)
    base = self if include_self else jnp.where(touched, _identity(reduce, dtype), self)
    at = base.at[idx]
    if dtype == jnp.bool_ and reduce in ("sum", "prod"):
        reduce = "amax" if reduce == "sum" else "amin"  # logical or / and
    if reduce == "sum":
        return at.add(src)
    if reduce == "prod":
        return at.multiply(src)
    if reduce == "amax":
        return at.max(src)
    if reduce == "amin":
        return at.min(src)
    if reduce == "mean":
        total = at.add(src)
        count = jnp.zeros(self.shape, jnp.int32).at[idx].add(1)
        if include_self:
            count = count + 1
        count = jnp.maximum(count, 1)
        if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
            return (total / count.astype(dtype)).astype(dtype)
        return jnp.floor_divide(total, count.astype(dtype)).astype(dtype)
    _identity(reduce, dtype)


@lower(aten.scatter_reduce.two)
def scatter_reduce(self, dim, index, src, reduce, include_self=True):
    if index.size == 0:
        return self
    if self.ndim == 0:
        return _reduce_into(
            self.reshape(1),
            (jnp.zeros(1, jnp.int32),),
            jnp.asarray(src).reshape(-1)[:1].astype(self.dtype),
            reduce,
            include_self,
        ).reshape(())
    dim, index, src = _prep_scatter(self, dim, index, src)
    return _reduce_into(self, _full_index(index, dim), src, reduce, include_self)


# ----------------------------------------------------------------------------- index_* along one dim


def _along(self, dim, index):
    dim = _dim(dim, max(self.ndim, 1))
    return (slice(None),) * dim + (narrow_index(index.reshape(-1), self.shape),)


def _source_along(self, dim, index, source):
    """source laid out like self[..., index, ...] (broadcast 0-dim cases)."""
    dim = _dim(dim, max(self.ndim, 1))
    shape = list(self.shape)
    shape[dim] = index.size
    return jnp.broadcast_to(
        jnp.asarray(source).reshape(tuple(shape)) if jnp.size(source) == np.prod(shape) else jnp.asarray(source),
        tuple(shape),
    ).astype(self.dtype)


def _scalar_self(fn):
    @functools.wraps(fn)
    def wrapped(self, dim, index, *args, **kwargs):
        if self.ndim == 0:
            return fn(self.reshape(1), 0, index, *args, **kwargs).reshape(())
        return fn(self, dim, index, *args, **kwargs)

    return wrapped


@lower(aten.index_select.default)
def index_select(self, dim, index):
    if self.ndim == 0:
        return self.reshape(1)[index.reshape(-1)].reshape(())
    dim = _dim(dim, self.ndim)
    return jnp.take(
        self, narrow_index(index.reshape(-1), self.shape), axis=dim, mode="clip" if self.shape[dim] else "fill"
    )


@lower(aten.index_add.default)
@_scalar_self
def index_add(self, dim, index, source, alpha=1):
    src = _source_along(self, dim, index, source)
    if not isinstance(alpha, (int, float)) or alpha != 1:
        src = (src * alpha).astype(self.dtype)
    if self.dtype == jnp.bool_:
        return self.at[_along(self, dim, index)].max(src)
    return self.at[_along(self, dim, index)].add(src)


@lower(aten.index_copy.default)
@_scalar_self
def index_copy(self, dim, index, source):
    return self.at[_along(self, dim, index)].set(_source_along(self, dim, index, source))


@lower(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
@_scalar_self
def index_fill(self, dim, index, value):
    return self.at[_along(self, dim, index)].set(jnp.asarray(value).astype(self.dtype))


@lower(aten.index_reduce.default)
@_scalar_self
def index_reduce(self, dim, index, source, reduce, include_self=True):
    return _reduce_into(self, _along(self, dim, index), _source_along(self, dim, index, source), reduce, include_self)


# ----------------------------------------------------------------------------- masks


@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    value = jnp.asarray(value)
    if jnp.issubdtype(value.dtype, jnp.complexfloating) and not jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise RuntimeError("value cannot be converted to type without overflow")
    return jnp.where(mask.astype(jnp.bool_), value.astype(self.dtype), self)


@lower(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    base = jnp.broadcast_to(self, shape)
    m = jnp.broadcast_to(mask.astype(jnp.bool_), shape).reshape(-1)
    src = source.reshape(-1).astype(self.dtype)
    if src.size == 0:
        return base
    pos = jnp.clip(jnp.cumsum(m.astype(jnp.int32)) - 1, 0, src.size - 1)
    return jnp.where(m, src[pos], base.reshape(-1)).reshape(shape)


def _need_concrete(name, *arrays):
    for a in arrays:
        if not _concrete(a):
            raise NotImplementedError(
                f"torchtpu: {name} has a data-dependent output shape and cannot be part of a compiled "
                "program; call it outside the compiled region or use a fixed-size alternative "
                "(torch.where, nonzero_static)"
            )


@lower(aten.masked_select.default, jit=False)
def masked_select(self, mask):
    _need_concrete("masked_select", mask)
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    m = np.broadcast_to(np.asarray(mask).astype(bool), shape)
    flat = np.flatnonzero(m)
    return _take_flat(jnp.broadcast_to(self, shape), jnp.asarray(flat))


@jax.jit
def _take_flat(x, idx):
    return x.reshape(-1)[idx]


@lower(aten.take.default)
def take(self, index):
    return self.reshape(-1)[index]


@lower(aten.put.default)
def put(self, index, source, accumulate=False):
    flat = self.reshape(-1)
    src = source.reshape(-1).astype(self.dtype)
    idx = index.reshape(-1)
    if idx.size == 0:
        return self
    if accumulate:
        out = flat.at[idx].max(src) if self.dtype == jnp.bool_ else flat.at[idx].add(src)
    else:
        out = flat.at[idx].set(src)
    return out.reshape(self.shape)


@lower(aten.take_along_dim.default)
def take_along_dim(self, indices, dim=None):
    if dim is None:
        return self.reshape(-1)[indices.reshape(-1)]
    dim = _dim(dim, self.ndim)
    shp_s = list(self.shape)
    shp_i = list(indices.shape)
    shp_s[dim] = 1
    shp_i[dim] = 1
    b = jnp.broadcast_shapes(tuple(shp_s), tuple(shp_i))
    s_shape = b[:dim] + (self.shape[dim],) + b[dim + 1 :]
    i_shape = b[:dim] + (indices.shape[dim],) + b[dim + 1 :]
    return jnp.take_along_axis(jnp.broadcast_to(self, s_shape), jnp.broadcast_to(indices, i_shape), axis=dim)


# ----------------------------------------------------------------------------- data-dependent shapes


@lower(aten.nonzero.default, jit=False)
def nonzero(self):
    _need_concrete("nonzero", self)
    a = np.asarray(self)
    if a.ndim == 0:
        return jnp.zeros((1 if a.item() else 0, 0), jnp.int64)
    return jnp.asarray(np.stack(np.nonzero(a), axis=1).astype(np.int64))


@lower(aten.nonzero_static.default, static=("fill_value",))
def nonzero_static(self, size, fill_value=-1):
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    if self.size == 0:
        return jnp.full((size, self.ndim), fill_value, jnp.int64)
    idx = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(idx, axis=1).astype(jnp.int64)


@lower(aten.argwhere.default, jit=False)
def argwhere(self):
    return nonzero(self)


def _unique_np(a, sorted_, return_inverse, return_counts):
    flat = a.reshape(-1)
    if flat.size == 0:
        return (flat, np.zeros(a.shape, np.int64), np.zeros(0, np.int64))
    vals, inv, counts = np.unique(flat, return_inverse=True, return_counts=True, equal_nan=False)
    return vals, inv.reshape(a.shape).astype(np.int64), counts.astype(np.int64)


@lower(aten._unique2.default, jit=False)
def _unique2(self, sorted=True, return_inverse=False, return_counts=False):
    _need_concrete("unique", self)
    a = np.asarray(self)
    vals, inv, counts = _unique_np(a, sorted, return_inverse, return_counts)
    return (
        jnp.asarray(vals, self.dtype),
        jnp.asarray(inv) if return_inverse else jnp.zeros(0, jnp.int64),
        jnp.asarray(counts) if return_counts else jnp.zeros(0, jnp.int64),
    )


@lower(aten._unique.default, jit=False)
def _unique(self, sorted=True, return_inverse=False):
    v, inv, _ = _unique2(self, sorted, return_inverse, False)
    return v, inv


def _consecutive(a, axis):
    """Start flags of runs of equal slices along `axis` of numpy array `a`."""
    n = a.shape[axis]
    moved = np.moveaxis(a, axis, 0).reshape(n, -1)
    if n == 0:
        return np.zeros(0, bool)
    diff = np.any(moved[1:] != moved[:-1], axis=1) if moved.shape[1] else np.zeros(n - 1, bool)
    return np.concatenate([[True], diff])


@lower(aten.unique_consecutive.default, jit=False)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    _need_concrete("unique_consecutive", self)
    a = np.asarray(self)
    if dim is None:
        flat = a.reshape(-1)
        starts = _consecutive(flat, 0)
        vals = flat[starts]
        inv = (np.cumsum(starts) - 1).reshape(a.shape)
    else:
        dim = _dim(dim, a.ndim)
        starts = _consecutive(a, dim)
        vals = np.compress(starts, a, axis=dim)
        inv = np.cumsum(starts) - 1
    bounds = np.flatnonzero(np.concatenate([starts, [True]]))
    counts = np.diff(bounds)
    return (
        jnp.asarray(vals, self.dtype),
        jnp.asarray(inv.astype(np.int64)) if return_inverse else jnp.zeros(0, jnp.int64),
        jnp.asarray(counts.astype(np.int64)) if return_counts else jnp.zeros(0, jnp.int64),
    )


@lower(aten.unique_dim.default, jit=False)
def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    _need_concrete("unique", self)
    a = np.asarray(self)
    dim = _dim(dim, a.ndim)
    moved = np.moveaxis(a, dim, 0)
    n = moved.shape[0]
    flat = moved.reshape(n, -1)
    if n == 0:
        vals, inv, counts = a, np.zeros(0, np.int64), np.zeros(0, np.int64)
    else:
        order = np.lexsort(flat.T[::-1]) if flat.shape[1] else np.arange(n)
        srt = flat[order]
        starts = (
            np.concatenate([[True], np.any(srt[1:] != srt[:-1], axis=1)])
            if flat.shape[1]
            else np.concatenate([[True], np.zeros(n - 1, bool)])
        )
        group = np.cumsum(starts) - 1
        inv = np.empty(n, np.int64)
        inv[order] = group
        vals = np.moveaxis(moved[order][starts], 0, dim)
        counts = np.diff(np.flatnonzero(np.concatenate([starts, [True]])))
    return (
        jnp.asarray(vals, self.dtype),
        jnp.asarray(inv.astype(np.int64)) if return_inverse else jnp.zeros(0, jnp.int64),
        jnp.asarray(np.asarray(counts, np.int64)) if return_counts else jnp.zeros(0, jnp.int64),
    )


@lower(aten.repeat_interleave.Tensor, jit=False)
def repeat_interleave_tensor(repeats, output_size=None):
    _need_concrete("repeat_interleave", repeats)
    r = np.asarray(repeats).reshape(-1)
    return jnp.asarray(np.repeat(np.arange(r.size, dtype=np.int64), r))


@lower(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin(elements, test_elements, assume_unique=False, invert=False):
    e = jnp.asarray(elements)
    t = jnp.asarray(test_elements).reshape(-1)
    if t.size == 0:
        out = jnp.zeros(e.shape, jnp.bool_)
    else:
        dt = jnp.promote_types(e.dtype, t.dtype)
        out = jnp.any(e.astype(dt)[..., None] == t.astype(dt), axis=-1)
    return ~out if invert else out


# ----------------------------------------------------------------------------- embedding


@lower(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0, mode="clip")


@lower(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = grad_output.reshape((idx.size, -1)) if idx.size else grad_output.reshape((0, grad_output.shape[-1]))
    compute = jnp.float32 if grad_output.dtype in (jnp.bfloat16, jnp.float16) else grad_output.dtype
    g = g.astype(compute)
    if padding_idx is not None and padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), compute), g)
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, compute).at[idx].add(1)
        g = g / counts[idx][:, None]
    out = jnp.zeros((num_weights, g.shape[-1]), compute).at[idx].add(g)
    return out.astype(grad_output.dtype)


@lower(aten.embedding_renorm.default)
def embedding_renorm(self, indices, max_norm, norm_type):
    """Rows of self named in indices rescaled to norm at most max_norm (each row once)."""
    idx = indices.reshape(-1)
    rows = self[idx].astype(jnp.float32 if self.dtype in (jnp.bfloat16, jnp.float16) else self.dtype)
    if norm_type == 1:
        norms = jnp.sum(jnp.abs(rows), axis=-1)
    elif norm_type == 2:
        norms = jnp.sqrt(jnp.sum(rows * rows, axis=-1))
    elif norm_type == float("inf"):
        norms = jnp.max(jnp.abs(rows), axis=-1)
    else:
        norms = jnp.sum(jnp.abs(rows) ** norm_type, axis=-1) ** (1.0 / norm_type)
    scale = jnp.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)
    # duplicates carry the same row and scale, so setting them all is idempotent
    return self.at[idx].set((rows * scale[:, None]).astype(self.dtype))


@lower(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    n = int(np.prod(sizes)) if len(sizes) else 1
    m = jnp.broadcast_to(mask.astype(jnp.bool_), grad_output.shape).reshape(-1)
    pos = jnp.cumsum(m.astype(jnp.int32)) - 1
    target = jnp.where(m, pos, n)  # unselected elements fall outside and are dropped
    out = jnp.zeros((n,), grad_output.dtype).at[target].set(grad_output.reshape(-1), mode="drop")
    return out.reshape(tuple(sizes))
