"""Reductions, scans, sorting and normalisation-by-reduction.

PyTorch's rules, kept here rather than left to JAX's:
- sums and products of integer/bool tensors accumulate (and return) int64; a `dtype=`
  argument casts the input before reducing; float16/bfloat16 accumulate in float32 like
  PyTorch's CPU kernels (the dispatcher casts the result back to PyTorch's output dtype);
- `dim=None` and `dim=[]` reduce over every dimension (except all/any.dims, where `[]` keeps
  the tensor as is); a 0-dim tensor accepts dim 0/-1 and reduces over nothing;
- max/min/amax/amin/argmax/median... propagate NaN, and their indices point at the first
  occurrence of the selected value (or of the first NaN);
- sort is stable and orders NaN above +inf (last ascending, first descending).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .. import dtypes
from ..registry import aten, lower

prims = __import__("torch").ops.prims

_LOW = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_I64 = jnp.int64


# ----------------------------------------------------------------------------- helpers


def _jdt(dtype):
    return None if dtype is None else dtypes.to_jax_dtype(dtype)


def _is_float(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def _is_complex(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.complexfloating)


def _is_inexact(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _compute(dt):
    """The dtype to accumulate in for a result of dtype `dt`."""
    dt = jnp.dtype(dt)
    return jnp.dtype(jnp.float32) if dt in _LOW else dt


def _up(a):
    """float16/bfloat16 -> float32 (PyTorch's CPU accumulation type); others unchanged."""
    return a.astype(jnp.float32) if a.dtype in _LOW else a


def _to_float(a):
    """Integer/bool -> float32 (PyTorch's default dtype); low floats -> float32."""
    if not _is_inexact(a):
        return a.astype(jnp.float32)
    return _up(a)


def _axes(dim, ndim, empty_means_all=True):
    """Normalise a `dim` argument (None, int, list) into a sorted tuple of axes."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    dim = list(dim)
    if not dim:
        return tuple(range(ndim)) if empty_means_all else ()
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dim}))


def _axis(dim, ndim):
    """One dimension; None for a 0-dim tensor (which has nothing to reduce or scan)."""
    if ndim == 0:
        return None
    return dim % ndim


def _count(shape, axes) -> int:
    n = 1
    for ax in axes:
        n *= shape[ax]
    return n


def _sum_dtype(a, dtype):
    if dtype is not None:
        return _jdt(dtype)
    if a.dtype == jnp.bool_ or jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.dtype(_I64)
    return a.dtype


def _nan_eq(a, v):
    """a == v, with NaN equal to NaN (to locate a NaN-propagated max/min)."""
    hit = a == v
    if _is_inexact(a):
        hit = hit | (jnp.isnan(a) & jnp.isnan(v))
    return hit


def _first_true(mask, axis, keepdims=False):
    return jnp.argmax(mask, axis=axis, keepdims=keepdims).astype(_I64)


def _wide_ok() -> bool:
    """float64 helpers are cheap here (CPU/GPU) but emulated and slow on TPU."""
    return jax.config.jax_enable_x64 and jax.default_backend() != "tpu"


def _no_bool(name, a):
    """PyTorch's CPU kernels for these ops reject bool tensors; so do we."""
    if a.dtype == jnp.bool_:
        raise RuntimeError(
            f"\"{name}\" is not implemented for 'Bool' tensors; convert the tensor with .int() or .float() first"
        )


def _no_complex(name, a):
    """Ordering ops are undefined for complex numbers (PyTorch raises too)."""
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        raise RuntimeError(f'"{name}" is not implemented for complex tensors; compare .abs() or .real instead')


def _zeros_index(shape):
    return jnp.zeros(shape, _I64)


# ----------------------------------------------------------------------------- sums and means


@lower(aten.sum.default, aten.sum.dim_IntList)
def sum_(self, dim=None, keepdim=False, *, dtype=None):
    out = _sum_dtype(self, dtype)
    return jnp.sum(self.astype(_compute(out)), axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    out = _sum_dtype(self, dtype)
    x = self.astype(_compute(out))
    if _is_inexact(x):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return jnp.sum(x, axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.mean.default, aten.mean.dim)
def mean(self, dim=None, keepdim=False, *, dtype=None):
    x = self.astype(_compute(_jdt(dtype))) if dtype is not None else _up(self)
    axes = _axes(dim, self.ndim)
    n = _count(self.shape, axes)
    s = jnp.sum(x, axis=axes, keepdims=keepdim)
    return s / jnp.asarray(n, s.dtype) if n else s * jnp.asarray(jnp.nan, s.dtype)


@lower(aten.nanmean.default)
def nanmean(self, dim=None, keepdim=False, *, dtype=None):
    x = self.astype(_compute(_jdt(dtype))) if dtype is not None else _up(self)
    axes = _axes(dim, self.ndim)
    ok = ~jnp.isnan(x)
    s = jnp.sum(jnp.where(ok, x, jnp.zeros((), x.dtype)), axis=axes, keepdims=keepdim)
    n = jnp.sum(ok, axis=axes, keepdims=keepdim)
    return s / n.astype(s.dtype)


@lower(aten.prod.default, aten.prod.dim_int)
def prod(self, dim=None, keepdim=False, *, dtype=None):
    out = _sum_dtype(self, dtype)
    return jnp.prod(self.astype(_compute(out)), axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.trace.default)
def trace(self):
    _no_bool("trace", self)
    out = _sum_dtype(self, None)
    return jnp.trace(self.astype(_compute(out)))


@lower(aten.trace_backward.default)
def trace_backward(grad, sizes):
    n, m = sizes
    eye = jnp.eye(n, m, dtype=jnp.bool_)
    return jnp.where(eye, grad, jnp.zeros((), grad.dtype))


# ----------------------------------------------------------------------------- extrema


@lower(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    _no_complex("amax", self)
    return jnp.max(self, axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    _no_complex("amin", self)
    return jnp.min(self, axis=_axes(dim, self.ndim), keepdims=keepdim)


def _ext_with_index(self, dim, keepdim, largest):
    _no_complex("max/min", self)
    ax = _axis(dim, self.ndim)
    if ax is None:
        return self, _zeros_index(())
    v = jnp.max(self, axis=ax, keepdims=True) if largest else jnp.min(self, axis=ax, keepdims=True)
    idx = _first_true(_nan_eq(self, v), ax, keepdims=keepdim)
    if not keepdim:
        v = jnp.squeeze(v, ax)
    return v, idx


@lower(aten.max.default)
def max_(self):
    _no_complex("max", self)
    return jnp.max(self)


@lower(aten.min.default)
def min_(self):
    _no_complex("min", self)
    return jnp.min(self)


@lower(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    return _ext_with_index(self, dim, keepdim, True)


@lower(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    return _ext_with_index(self, dim, keepdim, False)


@lower(aten.aminmax.default)
def aminmax(self, *, dim=None, keepdim=False):
    _no_complex("aminmax", self)
    axes = _axes(dim, self.ndim)
    return (jnp.min(self, axis=axes, keepdims=keepdim), jnp.max(self, axis=axes, keepdims=keepdim))


def _arg_ext(self, dim, keepdim, largest):
    _no_complex("argmax/argmin", self)
    _no_bool("argmax/argmin", self)
    if dim is None:
        x = self.reshape(-1)
        v = jnp.max(x) if largest else jnp.min(x)
        idx = _first_true(_nan_eq(x, v), 0)
        return idx.reshape((1,) * self.ndim) if keepdim else idx
    return _ext_with_index(self, dim, keepdim, largest)[1]


@lower(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    return _arg_ext(self, dim, keepdim, True)


@lower(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _arg_ext(self, dim, keepdim, False)


@lower(aten.value_selecting_reduction_backward.default)
def value_selecting_reduction_backward(grad, dim, indices, sizes, keepdim):
    sizes = tuple(sizes)
    if len(sizes) == 0:
        return grad.reshape(())
    ax = dim % len(sizes)
    if not keepdim:
        grad = jnp.expand_dims(grad, ax)
        indices = jnp.expand_dims(indices, ax)
    out = jnp.zeros(sizes, grad.dtype)
    return jnp.put_along_axis(out, indices, grad, axis=ax, inplace=False)


# ----------------------------------------------------------------------------- logical


@lower(aten.all.default, aten.all.dim, aten.all.dims)
def all_(self, dim=None, keepdim=False):
    return jnp.all(self.astype(jnp.bool_), axis=_axes(dim, self.ndim, empty_means_all=False), keepdims=keepdim)


@lower(aten._is_all_true.default)
def is_all_true(self):
    # torch.distributions' argument validation (a bool tensor's all)
    return jnp.all(self)


@lower(aten.any.default, aten.any.dim, aten.any.dims)
def any_(self, dim=None, keepdim=False):
    return jnp.any(self.astype(jnp.bool_), axis=_axes(dim, self.ndim, empty_means_all=False), keepdims=keepdim)


@lower(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(self, dim=None):
    return jnp.sum(self != 0, axis=_axes(dim, self.ndim), dtype=_I64)


# ----------------------------------------------------------------------------- moments


def _correction(unbiased=True, correction=None):
    if correction is not None:
        return correction
    return 1 if unbiased else 0


def _var_mean(x, axes, correction, keepdim):
    if not _is_inexact(x):
        raise RuntimeError(
            f"std and var only support floating point and complex dtypes, got {x.dtype}; "
            "convert the tensor with .float() first"
        )
    x = _to_float(x)
    n = _count(x.shape, axes)
    m = (
        jnp.mean(x, axis=axes, keepdims=True)
        if n
        else jnp.full(tuple(1 if i in axes else s for i, s in enumerate(x.shape)), jnp.nan, x.dtype)
    )
    d = x - m
    sq = (d.real * d.real + d.imag * d.imag) if _is_complex(d) else d * d
    s = jnp.sum(sq, axis=axes, keepdims=keepdim)
    denom = jnp.maximum(jnp.asarray(n, s.dtype) - jnp.asarray(correction, s.dtype), 0)
    var = s / denom
    if not keepdim:
        m = jnp.squeeze(m, axes) if axes else m
    return var, m


@lower(aten.var.default, aten.var.dim, aten.var.correction)
def var(self, dim=None, unbiased=True, keepdim=False, *, correction=None):
    if isinstance(dim, bool):  # var.default(self, unbiased)
        dim, unbiased = None, dim
    return _var_mean(self, _axes(dim, self.ndim), _correction(unbiased, correction), keepdim)[0]


@lower(aten.std.default, aten.std.dim, aten.std.correction)
def std(self, dim=None, unbiased=True, keepdim=False, *, correction=None):
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    return jnp.sqrt(_var_mean(self, _axes(dim, self.ndim), _correction(unbiased, correction), keepdim)[0])


@lower(aten.var_mean.default, aten.var_mean.dim, aten.var_mean.correction)
def var_mean(self, dim=None, unbiased=True, keepdim=False, *, correction=None):
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    return _var_mean(self, _axes(dim, self.ndim), _correction(unbiased, correction), keepdim)


@lower(aten.std_mean.default, aten.std_mean.dim, aten.std_mean.correction)
def std_mean(self, dim=None, unbiased=True, keepdim=False, *, correction=None):
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    v, m = _var_mean(self, _axes(dim, self.ndim), _correction(unbiased, correction), keepdim)
    return jnp.sqrt(v), m


# ----------------------------------------------------------------------------- norms


def _vector_norm(x, ord, axes, keepdim):
    if (ord < 0 or ord == math.inf) and any(x.shape[ax] == 0 for ax in axes):
        raise RuntimeError(
            f"linalg.vector_norm cannot compute the {ord} norm on an empty dimension because the "
            "operation does not have an identity; use ord >= 0 (not inf) or reduce over non-empty dims"
        )
    a = jnp.abs(_to_float(x))
    if ord == math.inf:
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    p = jnp.asarray(ord, a.dtype)
    return jnp.sum(a**p, axis=axes, keepdims=keepdim) ** (1 / p)


@lower(aten.linalg_vector_norm.default, static=("ord",))
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = self.astype(_jdt(dtype)) if dtype is not None else self
    return _vector_norm(x, ord, _axes(dim, self.ndim), keepdim)


@lower(
    aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype, static=("p",)
)
def norm(self, p=2, dim=None, keepdim=False, *, dtype=None):
    x = self.astype(_jdt(dtype)) if dtype is not None else self
    return _vector_norm(x, 2 if p is None else p, _axes(dim, self.ndim), keepdim)


# ----------------------------------------------------------------------------- softmax family


def _max_keep(x, axis):
    m = jnp.max(x, axis=axis, keepdims=True, initial=-jnp.inf) if x.size == 0 else jnp.max(x, axis=axis, keepdims=True)
    return lax.stop_gradient(m)


@lower(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    x = _to_float(self)
    axes = _axes(dim, self.ndim)
    if _is_complex(x):
        m = lax.stop_gradient(jnp.max(x.real, axis=axes, keepdims=True, initial=-jnp.inf))
    else:
        m = lax.stop_gradient(jnp.max(x, axis=axes, keepdims=True, initial=-jnp.inf))
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))
    r = jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True)) + m
    return r if keepdim else jnp.squeeze(r, axes)


def _softmax_impl(x, dim):
    ax = _axis(dim, x.ndim)
    if ax is None:
        return jnp.exp(x - x)
    m = _max_keep(x, ax)
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=ax, keepdims=True)


def _log_softmax_impl(x, dim):
    ax = _axis(dim, x.ndim)
    if ax is None:
        return x - x
    m = _max_keep(x, ax)
    s = x - m
    return s - jnp.log(jnp.sum(jnp.exp(s), axis=ax, keepdims=True))


@lower(aten._softmax.default)
def _softmax(self, dim, half_to_float):
    return _softmax_impl(_up(self), dim)


@lower(aten._log_softmax.default)
def _log_softmax(self, dim, half_to_float):
    return _log_softmax_impl(_up(self), dim)


@lower(aten.softmax.int)
def softmax(self, dim, dtype=None):
    x = self.astype(_jdt(dtype)) if dtype is not None else self
    return _softmax_impl(_up(x), dim)


@lower(aten.log_softmax.int)
def log_softmax(self, dim, dtype=None):
    x = self.astype(_jdt(dtype)) if dtype is not None else self
    return _log_softmax_impl(_up(x), dim)


@lower(aten._safe_softmax.default)
def _safe_softmax(self, dim, dtype=None):
    x = _up(self.astype(_jdt(dtype)) if dtype is not None else self)
    out = _softmax_impl(x, dim)
    ax = _axis(dim, x.ndim)
    dead = jnp.all(x == -jnp.inf, axis=ax, keepdims=True) if ax is not None else (x == -jnp.inf)
    return jnp.where(dead, jnp.zeros((), out.dtype), out)


@lower(aten._softmax_backward_data.default)
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _up(grad_output), _up(output)
    ax = _axis(dim, y.ndim)
    s = jnp.sum(g * y, axis=ax, keepdims=True) if ax is not None else g * y
    return y * (g - s)


@lower(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _up(grad_output), _up(output)
    ax = _axis(dim, y.ndim)
    s = jnp.sum(g, axis=ax, keepdims=True) if ax is not None else g
    return g - jnp.exp(y) * s


# ----------------------------------------------------------------------------- scans


def _cumulative(scan, op):
    """Register `scan` (jnp.cumsum, jnp.cumprod) for `op`, in the dtype sum would give."""

    def low(self, dim, *, dtype=None):
        out = _sum_dtype(self, dtype)
        x = self.astype(_compute(out))
        ax = _axis(dim, x.ndim)
        return x if ax is None else scan(x, axis=ax)

    lower(op)(low)


_cumulative(jnp.cumsum, aten.cumsum.default)
_cumulative(jnp.cumprod, aten.cumprod.default)


@lower(aten.cumprod_backward.default)
def cumprod_backward(grad, input, dim, output):
    x = _up(input)
    ax = _axis(dim, x.ndim)
    if ax is None:
        return grad
    _, vjp = jax.vjp(lambda v: jnp.cumprod(v, axis=ax), x)
    return vjp(grad.astype(x.dtype))[0]


@lower(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    _no_bool("logcumsumexp", self)
    x = _to_float(self)
    ax = _axis(dim, x.ndim)
    if ax is None:
        return x
    if x.shape[ax] == 0:
        return x
    if _is_complex(x):
        return lax.associative_scan(jnp.logaddexp, x, axis=ax)
    if x.dtype == jnp.float32 and _wide_ok():
        # The gradient formula PyTorch uses for logcumsumexp cancels catastrophically; a
        # correctly rounded float32 scan (as PyTorch's CPU kernel nearly gives) keeps it close.
        return lax.cumlogsumexp(x.astype(jnp.float64), axis=ax).astype(jnp.float32)
    return lax.cumlogsumexp(x, axis=ax)


def _cum_ext(self, dim, largest):
    _no_complex("cummax/cummin", self)
    ax = _axis(dim, self.ndim)
    if ax is None:
        return self, _zeros_index(())
    if self.shape[ax] == 0:
        return self, _zeros_index(self.shape)
    idx = lax.broadcasted_iota(_I64, self.shape, ax)
    nan_aware = _is_float(self)

    def combine(a, b):
        va, ia = a
        vb, ib = b
        take_b = (vb >= va) if largest else (vb <= va)
        if nan_aware:
            take_b = jnp.isnan(vb) | (take_b & ~jnp.isnan(va))
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    return lax.associative_scan(combine, (self, idx), axis=ax)


@lower(aten.cummax.default)
def cummax(self, dim):
    return _cum_ext(self, dim, True)


@lower(aten.cummin.default)
def cummin(self, dim):
    return _cum_ext(self, dim, False)


@lower(aten._cummax_helper.default)
def _cummax_helper(self, values, indices, dim):
    v, i = _cum_ext(self, dim, True)
    return v, i


@lower(aten._cummin_helper.default)
def _cummin_helper(self, values, indices, dim):
    v, i = _cum_ext(self, dim, False)
    return v, i


# ----------------------------------------------------------------------------- sorting


def _sort(x, ax, descending):
    """Stable sort along `ax`: (values, int64 indices). NaN sorts above +inf."""
    _no_complex("sort", x)
    # the positions travel through the sort as int32 where they fit (TPUs emulate 64-bit integers,
    # as pairs of 32-bit words through the sort) and come out as PyTorch's int64
    narrow = jnp.int32 if x.shape[ax] < 2**31 else _I64
    idx = lax.broadcasted_iota(narrow, x.shape, ax)
    if x.shape[ax] <= 1:
        return x, idx.astype(_I64)
    if not descending:
        values, indices = lax.sort((x, idx), dimension=ax, is_stable=True, num_keys=1)
        return values, indices.astype(_I64)
    if _is_float(x):
        keys = ((~jnp.isnan(x)).astype(jnp.uint8), -x)
    else:
        keys = (~x,)
    out = lax.sort((*keys, x, idx), dimension=ax, is_stable=True, num_keys=len(keys))
    return out[-2], out[-1].astype(_I64)


@lower(aten.sort.default)
def sort(self, dim=-1, descending=False):
    ax = _axis(dim, self.ndim)
    if ax is None:
        return self, _zeros_index(())
    return _sort(self, ax, descending)


@lower(aten.sort.stable)
def sort_stable(self, *, stable=None, dim=-1, descending=False):
    return sort(self, dim, descending)


@lower(aten.argsort.default)
def argsort(self, dim=-1, descending=False):
    return sort(self, dim, descending)[1]


@lower(aten.argsort.stable)
def argsort_stable(self, *, stable=False, dim=-1, descending=False):
    return sort(self, dim, descending)[1]


@lower(aten.msort.default)
def msort(self):
    return sort(self, 0, False)[0]


@lower(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    _no_bool("topk", self)
    ax = _axis(dim, self.ndim)
    if ax is None:
        return self, _zeros_index(())
    values, indices = _sort(self, ax, largest)
    return lax.slice_in_dim(values, 0, k, axis=ax), lax.slice_in_dim(indices, 0, k, axis=ax)


def _take(a, pos, ax, keepdim):
    """a[..., pos, ...] along `ax` where pos (keepdims-shaped) may vary along the other axes."""
    out = jnp.take_along_axis(a, pos, axis=ax)
    return out if keepdim else jnp.squeeze(out, ax)


@lower(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    _no_bool("kthvalue", self)
    ax = _axis(dim, self.ndim)
    if ax is None:
        return self, _zeros_index(())
    _nonempty_dim("kthvalue", self.shape, ax)
    values, indices = _sort(self, ax, False)
    v = lax.slice_in_dim(values, k - 1, k, axis=ax)
    i = lax.slice_in_dim(indices, k - 1, k, axis=ax)
    return (v, i) if keepdim else (jnp.squeeze(v, ax), jnp.squeeze(i, ax))


def _nonempty_dim(name, shape, ax):
    if shape[ax] == 0:
        raise IndexError(f"{name}(): Expected reduction dim {ax} to have non-zero size.")


def _median_dim(self, ax, keepdim, ignore_nan):
    _no_bool("median", self)
    n = self.shape[ax]
    _nonempty_dim("median", self.shape, ax)
    values, indices = _sort(self, ax, False)
    if ignore_nan and _is_float(self):
        valid = jnp.sum(~jnp.isnan(self), axis=ax, keepdims=True)
        pos = jnp.maximum((valid - 1) // 2, 0).astype(_I64)
        return _take(values, pos, ax, keepdim), _take(indices, pos, ax, keepdim)
    k = (n - 1) // 2
    v = lax.slice_in_dim(values, k, k + 1, axis=ax)
    i = lax.slice_in_dim(indices, k, k + 1, axis=ax)
    if _is_float(self):
        isnan = jnp.isnan(self)
        has_nan = jnp.any(isnan, axis=ax, keepdims=True)
        v = jnp.where(has_nan, jnp.full((), jnp.nan, v.dtype), v)
        i = jnp.where(has_nan, _first_true(isnan, ax, keepdims=True), i)
    return (v, i) if keepdim else (jnp.squeeze(v, ax), jnp.squeeze(i, ax))


def _median(packet, ignore_nan):
    """Register median (or nanmedian, which skips NaNs: ignore_nan) along a dim and of all elements."""

    def along_dim(self, dim, keepdim=False):
        ax = _axis(dim, self.ndim)
        if ax is None:
            return self, _zeros_index(())
        return _median_dim(self, ax, keepdim, ignore_nan)

    def of_all(self):
        _no_bool(packet.__name__, self)
        if self.size == 0:
            return jnp.full((), jnp.nan, self.dtype if _is_inexact(self) else jnp.float32)
        return _median_dim(self.reshape(-1), 0, False, ignore_nan)[0]

    lower(packet.dim)(along_dim)
    lower(packet.default)(of_all)


_median(aten.median, False)
_median(aten.nanmedian, True)


@lower(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    """Most frequent value along `dim` (the smallest among equally frequent ones), and the
    index of its last occurrence, like PyTorch's CPU kernel."""
    ax = _axis(dim, self.ndim)
    if ax is None:
        return self, _zeros_index(())
    n = self.shape[ax]
    _nonempty_dim("mode", self.shape, ax)
    values, indices = _sort(self, ax, False)
    pos = lax.broadcasted_iota(_I64, self.shape, ax)
    prev = jnp.concatenate(
        [lax.slice_in_dim(values, 0, 1, axis=ax), lax.slice_in_dim(values, 0, n - 1, axis=ax)], axis=ax
    )
    nxt = jnp.concatenate(
        [lax.slice_in_dim(values, 1, n, axis=ax), lax.slice_in_dim(values, n - 1, n, axis=ax)], axis=ax
    )
    first = pos == 0
    last = pos == n - 1
    is_start = first | (values != prev)
    is_end = last | (values != nxt)
    start = lax.cummax(jnp.where(is_start, pos, 0), axis=ax)
    end = lax.cummin(jnp.where(is_end, pos, n - 1), axis=ax, reverse=True)
    counts = end - start + 1
    best = _first_true(counts == jnp.max(counts, axis=ax, keepdims=True), ax, keepdims=True)
    best_end = jnp.take_along_axis(end, best, axis=ax)
    v = _take(values, best, ax, keepdim)
    i = _take(indices, best_end, ax, keepdim)
    return v, i


# ----------------------------------------------------------------------------- searching and counting


def _searchsorted(seq, values, right):
    side = "right" if right else "left"
    dt = jnp.result_type(seq, values)
    seq, values = seq.astype(dt), values.astype(dt)
    if seq.ndim <= 1:
        return jnp.searchsorted(seq, values, side=side, method="compare_all" if seq.size <= 64 else "scan")
    m = seq.shape[-1]
    flat_seq = seq.reshape(-1, m)
    flat_val = values.reshape(flat_seq.shape[0], -1)
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(flat_seq, flat_val)
    return out.reshape(values.shape)


@lower(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    seq = sorted_sequence
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter.astype(_I64), axis=-1)
    values = jnp.asarray(self)
    if values.ndim == 0 and seq.ndim > 1:
        raise ValueError("torchtpu searchsorted: a scalar value needs a 1-D sorted_sequence")
    out = _searchsorted(seq, values, right or side == "right")
    return out.astype(jnp.int32 if out_int32 else _I64)


@lower(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    out = _searchsorted(boundaries, jnp.asarray(self), right)
    return out.astype(jnp.int32 if out_int32 else _I64)


@lower(aten.histc.default, static=("bins",))
def histc(self, bins=100, min=0, max=0):
    _no_bool("histc", self)
    if not _is_inexact(self):
        return _histc_int(self, bins, min, max)
    x = _to_float(self)
    lo = jnp.asarray(min, x.dtype)
    hi = jnp.asarray(max, x.dtype)
    if x.size:
        same = lo == hi
        lo = jnp.where(same, jnp.min(x), lo)
        hi = jnp.where(same, jnp.max(x), hi)
    eq = lo == hi
    lo = jnp.where(eq, lo - 1, lo)
    hi = jnp.where(eq, hi + 1, hi)
    flat = x.reshape(-1)
    pos = (flat - lo) / (hi - lo) * bins
    ok = (flat >= lo) & (flat <= hi)
    pos = jnp.clip(jnp.where(ok, pos, 0), 0, bins - 1).astype(jnp.int32)
    return _count_bins(pos, ok, bins, x.dtype)


# Up to this many bins, histc counts by comparing every element with every bin and summing (a
# fused compare-and-reduce): XLA's TPU cost model gives no time for a program holding a scatter
# of scalars, which is what counting by scatter-add is, so a Mixture-of-Experts step (its router
# counts tokens per expert with histc) would get no step-time estimate. More bins: scatter-add.
_COMPARE_BINS = 4096


def _count_bins(pos, ok, bins, dtype):
    """Counts (in `dtype`) of the positions `pos` (int32 in [0, bins)) where `ok`."""
    if bins <= _COMPARE_BINS:
        hit = (pos[:, None] == jnp.arange(bins, dtype=pos.dtype)[None, :]) & ok[:, None]
        return jnp.sum(hit, axis=0, dtype=dtype)
    return jnp.zeros((bins,), dtype).at[pos].add(ok.astype(dtype))


def _histc_int(self, bins, min, max):
    """histc of integers, as PyTorch's CUDA kernel counts them: the counts in the input's dtype,
    bin = (x - min) * bins // (max - min) in integer arithmetic (so x = min + k exactly lands in
    bin k when max - min == bins, as torchtitan's MoE router relies on), and x == max in the last
    bin; min == max means the data's own range."""
    x = self.reshape(-1).astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    lo, hi = jnp.asarray(min).astype(x.dtype), jnp.asarray(max).astype(x.dtype)
    if x.size:
        same = lo == hi
        lo, hi = jnp.where(same, jnp.min(x), lo), jnp.where(same, jnp.max(x), hi)
    width = jnp.maximum(hi - lo, 1)
    ok = (x >= lo) & (x <= hi)
    pos = jnp.clip(jnp.where(ok, (x - lo) * bins // width, 0), 0, bins - 1).astype(jnp.int32)
    return _count_bins(pos, ok, bins, self.dtype)


# ----------------------------------------------------------------------------- prims (emitted by torch decompositions)


def _prim_dims(dims, ndim):
    return tuple(range(ndim)) if dims is None else tuple(d % ndim for d in dims) if ndim else ()


@lower(prims.sum.default)
def prims_sum(inp, dims, *, output_dtype=None):
    x = inp.astype(_compute(_jdt(output_dtype))) if output_dtype is not None else _up(inp)
    return jnp.sum(x, axis=_prim_dims(dims, inp.ndim))


@lower(prims.prod.default)
def prims_prod(inp, dims, *, output_dtype=None):
    x = inp.astype(_compute(_jdt(output_dtype))) if output_dtype is not None else _up(inp)
    return jnp.prod(x, axis=_prim_dims(dims, inp.ndim))


@lower(prims.amax.default)
def prims_amax(inp, dims, *, output_dtype=None):
    return jnp.max(inp, axis=_prim_dims(dims, inp.ndim))


@lower(prims.amin.default)
def prims_amin(inp, dims, *, output_dtype=None):
    return jnp.min(inp, axis=_prim_dims(dims, inp.ndim))


@lower(prims.var.default)
def prims_var(inp, dims, correction=1, *, output_dtype=None):
    return _var_mean(inp, _prim_dims(dims, inp.ndim), 1 if correction is None else correction, False)[0]


@lower(prims.xor_sum.default)
def prims_xor_sum(inp, dims, *, output_dtype=None):
    axes = _prim_dims(dims, inp.ndim)
    if inp.dtype == jnp.bool_:
        return (jnp.sum(inp, axis=axes, dtype=jnp.int32) % 2).astype(jnp.bool_)
    return lax.reduce(inp, jnp.zeros((), inp.dtype), lax.bitwise_xor, axes)
