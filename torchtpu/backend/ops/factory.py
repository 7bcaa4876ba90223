"""Factory ops: arange, linspace, logspace, eye, full_like, new_full, tril/triu_indices...

`torch.arange(..., device="tpu")` and friends are composite in PyTorch: they allocate an empty
tpu tensor and call the `out=` overload (`arange.start_out`, `linspace.out`, `eye.m_out`...),
whose output size depends on the bounds. Those `out=` overloads get bespoke handlers here: the
bounds are plain Python numbers, the values are computed by a small executable cached per
output shape, and the result is written into (a resized) `out`.

Values follow PyTorch's CPU kernels: arange computes `start + i * step` in double precision
(integer dtypes: in int64) and casts once; linspace fills the first half from `start` and the
second half from `end`, so both ends are exact.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes
from ..registry import array_of, aten, bind, custom, is_tracing, lower, write_value
from ..tensor import TpuTensor, place, storage_of


def _scalar(x):
    """A Python number from a Scalar argument or a 0-dim tensor."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise RuntimeError(f"expected a 0-dim tensor for a scalar bound, got shape {tuple(x.shape)}")
        if isinstance(x, TpuTensor):
            v = np.asarray(array_of(x)).reshape(())
        else:
            v = dtypes.torch_to_numpy(x).reshape(())
        return v.item()
    return x


def write_out(out, value):
    """Write `value` (computed for `out`'s dtype) into `out`, resizing it, and return `out`."""
    jdt = dtypes.to_jax_dtype(out.dtype)
    if value.dtype != jdt:
        value = value.astype(jdt)
    if not is_tracing() and isinstance(out, TpuTensor):
        value = place(value, storage_of(out).device_index)
    write_value(out, value, resize=True)
    return out


def _out_handler(*ops):
    """Register `fn(bound_args, out_dtype) -> jax array` as the handler of `out=` factory overloads."""

    def register(fn):
        for op in ops:

            def h(args, kwargs, _op=op):
                b = bind(_op, args, kwargs)
                out = b.pop("out")
                return write_out(out, fn(b, out))

            custom(op)(h)
        return fn

    return register


# ----------------------------------------------------------------------------- arange


def _is_int_dtype(dt: torch.dtype) -> bool:
    return not (dt.is_floating_point or dt.is_complex) and dt != torch.bool


@functools.cache
def _arange_exe(n, jdt, integer):
    if integer:
        return jax.jit(lambda start, step: (start + step * jnp.arange(n, dtype=jnp.int64)).astype(jdt))
    return jax.jit(lambda start, step: (start + step * jnp.arange(n, dtype=jnp.float64)).astype(jdt))


def _arange_values(start, end, step, out_dtype):
    for name, v in (("start", start), ("end", end), ("step", step)):
        if isinstance(v, float) and not math.isfinite(v):
            raise RuntimeError(f"arange: unsupported range: {start} -> {end} ({name} = {v} is not finite)")
    integer = _is_int_dtype(out_dtype)
    size_bounds = (start, end, step)
    if integer:
        # PyTorch's CPU kernel accumulates integer ranges in int64: bounds truncate first
        # (and for int64 outputs the size is computed from the truncated bounds too).
        start, step = int(start), int(step)
        if out_dtype == torch.int64:
            size_bounds = (start, int(end), step)
    if step == 0:
        raise RuntimeError("arange: step must be nonzero")
    s0, e0, st0 = size_bounds
    if (st0 > 0 and s0 > e0) or (st0 < 0 and s0 < e0):
        raise RuntimeError(
            f"arange: upper bound and larger bound inconsistent with step sign (start={start}, end={end}, step={step})"
        )
    if all(isinstance(v, int) for v in size_bounds):
        n = max(0, -((s0 - e0) // st0)) if st0 > 0 else max(0, -((e0 - s0) // -st0))
    else:
        n = max(0, math.ceil((float(e0) - float(s0)) / float(st0)))
    jdt = dtypes.to_jax_dtype(out_dtype)
    if n == 0:
        return jnp.zeros((0,), jdt)
    if integer:
        return _arange_exe(n, jdt, True)(np.int64(int(start)), np.int64(int(step)))
    return _arange_exe(n, jdt, False)(np.float64(start), np.float64(step))


@_out_handler(aten.arange.start_out)
def arange_start_out(b, out):
    return _arange_values(_scalar(b["start"]), _scalar(b["end"]), _scalar(b["step"]), out.dtype)


@_out_handler(aten.arange.out)
def arange_out(b, out):
    return _arange_values(0, _scalar(b["end"]), 1, out.dtype)


# ----------------------------------------------------------------------------- linspace / logspace


@functools.cache
def _linspace_exe(steps, jdt, log):
    def f(start, end, base):
        i = jnp.arange(steps, dtype=jnp.float64)
        step = (end - start) / max(steps - 1, 1)
        half = steps // 2
        v = jnp.where(i < half, start + step * i, end - step * (steps - 1 - i))
        if steps == 1:
            v = jnp.full((1,), start, jnp.float64)
        if log:
            v = jnp.power(base, v)
        if jnp.issubdtype(jdt, jnp.integer):
            return v.astype(jnp.int64).astype(jdt)
        return v.astype(jdt)

    return jax.jit(f)


def _linspace(b, out, log):
    steps = int(b["steps"])
    if steps < 0:
        raise RuntimeError(f"linspace: number of steps must be non-negative, got {steps}")
    start, end = _scalar(b["start"]), _scalar(b["end"])
    jdt = dtypes.to_jax_dtype(out.dtype)
    if steps == 0:
        return jnp.zeros((0,), jdt)
    if out.dtype.is_complex or isinstance(start, complex) or isinstance(end, complex):
        i = jnp.arange(steps, dtype=jnp.float64)
        step = (complex(end) - complex(start)) / max(steps - 1, 1)
        v = complex(start) + step * i
        return (jnp.power(float(b.get("base", 10.0)), v) if log else v).astype(jdt)
    if not log and _is_int_dtype(out.dtype):
        # PyTorch's integer linspace: integer bounds, a fractional step, truncation toward zero.
        start, end = int(start), int(end)
    base = float(b.get("base", 10.0)) if log else 10.0
    return _linspace_exe(steps, jdt, log)(np.float64(start), np.float64(end), np.float64(base))


@_out_handler(
    aten.linspace.out, aten.linspace.Tensor_Tensor_out, aten.linspace.Tensor_Scalar_out, aten.linspace.Scalar_Tensor_out
)
def linspace_out(b, out):
    return _linspace(b, out, log=False)


@_out_handler(
    aten.logspace.out, aten.logspace.Tensor_Tensor_out, aten.logspace.Tensor_Scalar_out, aten.logspace.Scalar_Tensor_out
)
def logspace_out(b, out):
    return _linspace(b, out, log=True)


# ----------------------------------------------------------------------------- eye, full


@functools.cache
def _eye_exe(n, m, jdt):
    return jax.jit(lambda: jnp.eye(n, m, dtype=jdt))


@_out_handler(aten.eye.out, aten.eye.m_out)
def eye_out(b, out):
    n = int(b["n"])
    m = n if b.get("m") is None else int(b["m"])
    if n < 0 or m < 0:
        raise RuntimeError(f"eye: n and m must be non-negative, got n={n}, m={m}")
    return _eye_exe(n, m, dtypes.to_jax_dtype(out.dtype))()


@_out_handler(aten.full.out)
def full_out(b, out):
    jdt = dtypes.to_jax_dtype(out.dtype)
    return jnp.full(tuple(b["size"]), _scalar(b["fill_value"]), jdt)


@_out_handler(aten.scalar_tensor.out)
def scalar_tensor_out(b, out):
    return jnp.asarray(_scalar(b["s"])).astype(dtypes.to_jax_dtype(out.dtype))


def _tri_indices(row, col, offset, lower_):
    r, c = np.indices((row, col)) if row and col else (np.zeros((0,), np.int64), np.zeros((0,), np.int64))
    if row and col:
        mask = (c - r <= offset) if lower_ else (c - r >= offset)
        return np.stack([r[mask], c[mask]]).astype(np.int64)
    return np.zeros((2, 0), np.int64)


@_out_handler(aten.tril_indices.out)
def tril_indices_out(b, out):
    return jnp.asarray(_tri_indices(int(b["row"]), int(b["col"]), int(b["offset"]), True))


@_out_handler(aten.triu_indices.out)
def triu_indices_out(b, out):
    return jnp.asarray(_tri_indices(int(b["row"]), int(b["col"]), int(b["offset"]), False))


# ----------------------------------------------------------------------------- functional factories


def _jdt(dtype, default):
    return dtypes.to_jax_dtype(dtype) if dtype is not None else default


@lower(aten.full_like.default)
def full_like(self, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    jdt = _jdt(dtype, self.dtype)
    return jnp.full(self.shape, fill_value).astype(jdt) if jdt != jnp.bool_ else jnp.full(self.shape, fill_value != 0)


@lower(aten.zeros_like.default)
def zeros_like(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(self.shape, _jdt(dtype, self.dtype))


@lower(aten.ones_like.default)
def ones_like(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(self.shape, _jdt(dtype, self.dtype))


@lower(aten.new_full.default)
def new_full(self, size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    jdt = _jdt(dtype, self.dtype)
    v = jnp.full(tuple(size), fill_value)
    return (v != 0) if jdt == jnp.bool_ else v.astype(jdt)


@lower(aten.new_zeros.default)
def new_zeros(self, size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _jdt(dtype, self.dtype))


@lower(aten.new_ones.default)
def new_ones(self, size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _jdt(dtype, self.dtype))


@lower(aten.polar.default)
def polar(abs, angle):
    abs, angle = jnp.broadcast_arrays(abs, angle)
    return jax.lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))


@lower(aten.complex.default)
def complex_(real, imag):
    real, imag = jnp.broadcast_arrays(real, imag)
    return jax.lax.complex(real, imag)


# ----------------------------------------------------------------------------- PrivateUse1 kernels
# Factories without tensor arguments and without a composite implementation need a kernel
# for the tpu backend itself.


def _device_index(device):
    """The internal index (tensor.internal_index) of a factory's device argument."""
    from ..tensor import internal_index

    if device is None:
        return internal_index(torch.tpu.current_device())
    device = torch.device(device)
    return internal_index(device.index if device.index is not None else torch.tpu.current_device())


def _make_tri(lower_):
    def kernel(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
        from ..tensor import new_base

        dt = dtype or torch.int64
        idx = _device_index(device)
        a = place(_tri_indices(int(row), int(col), int(offset), lower_).astype(dtypes.to_jax_dtype(dt)), idx)
        return new_base(a, idx, dt)

    return kernel


_LIB = torch.library.Library("aten", "IMPL")
_LIB.impl("tril_indices", _make_tri(True), "PrivateUse1")
_LIB.impl("triu_indices", _make_tri(False), "PrivateUse1")


# ----------------------------------------------------------------------------- tensor bounds


def _bounds_as_numbers(default_op):
    """linspace/logspace with 0-dim tensor bounds, as ATen defines them: the bounds are read to
    numbers and the output goes to the `device` argument (the default device when None), not
    to the bounds' device."""

    def handler(args, kwargs):
        vals = [
            np.asarray(array_of(a)).reshape(()).item()
            if isinstance(a, TpuTensor)
            else a.item()
            if isinstance(a, torch.Tensor)
            else a
            for a in args
        ]
        return default_op(*vals, **kwargs)

    return handler


for _op in (aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor):
    custom(_op)(_bounds_as_numbers(aten.linspace.default))
for _op in (aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor):
    custom(_op)(_bounds_as_numbers(aten.logspace.default))
