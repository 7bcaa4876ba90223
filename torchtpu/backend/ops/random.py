"""Random ops. Each lowering receives `key`, a JAX PRNG key drawn from the tpu generator
(backend/random.py: seed + offset), so `torch.manual_seed` makes every stream reproducible
and the key is a traced input (no recompiles per call).

The streams are not bit-identical to PyTorch's CPU generator (a different algorithm); the
distributions and the integer ranges are PyTorch's: `random_(from, to)` draws in [from, to),
`random_()` in [0, 2**mantissa] for floating types and [0, max] for integer types, `randint`
excludes `high`. A `generator=` argument is accepted and ignored: the device generator is used.

Low-precision floating outputs (bfloat16/float16) are sampled in float32 and rounded once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes
from ..registry import aten, bind, custom, lower, plan_for, run, write_value
from ..tensor import TpuTensor, storage_of


def _sample_dtype(dt):
    dt = jnp.dtype(dt)
    if dt in (jnp.float64,):
        return jnp.float64
    return jnp.float32


def _uniform(key, shape, dt, lo=0.0, hi=1.0):
    if jnp.dtype(dt) in (jnp.bfloat16, jnp.float16):
        # sampled in the low-precision type itself: rounding a float32 sample could reach `hi`
        return jax.random.uniform(key, shape, dt, lo, hi)
    return jax.random.uniform(key, shape, _sample_dtype(dt), lo, hi)


def _normal(key, shape, dt):
    return jax.random.normal(key, shape, _sample_dtype(dt))


def _jdt(dtype, default):
    return dtypes.to_jax_dtype(dtype) if dtype is not None else default


# ----------------------------------------------------------------------------- uniform / normal


def uniform(self, lo=0.0, to=1.0, *, key):
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        rdt = jnp.float64 if self.dtype == jnp.complex128 else jnp.float32
        k1, k2 = jax.random.split(key)
        return jax.lax.complex(_uniform(k1, self.shape, rdt, lo, to), _uniform(k2, self.shape, rdt, lo, to))
    return _uniform(key, self.shape, self.dtype, lo, to)


# the schema's first Scalar is named `from` (a Python keyword): accept it positionally or by name
def _uniform_entry(self, *args, key, **kwargs):
    names = ["from", "to", "generator"]
    vals = {"from": 0.0, "to": 1.0, "generator": None}
    vals.update(dict(zip(names, args)))
    vals.update(kwargs)
    return uniform(self, vals["from"], vals["to"], key=key)


lower(aten.uniform.default, random=True)(_uniform_entry)


@lower(aten.rand_like.default, aten.rand_like.generator, random=True)
def rand_like(self, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key):
    jdt = _jdt(dtype, self.dtype)
    if jnp.issubdtype(jdt, jnp.complexfloating):
        return uniform(jnp.zeros(self.shape, jdt), key=key)
    return _uniform(key, self.shape, jdt).astype(jdt)


@lower(aten.randn_like.default, aten.randn_like.generator, random=True)
def randn_like(self, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key):
    jdt = _jdt(dtype, self.dtype)
    if jnp.issubdtype(jdt, jnp.complexfloating):
        # PyTorch: real and imaginary parts each with variance 1/2
        rdt = jnp.float64 if jdt == jnp.complex128 else jnp.float32
        k1, k2 = jax.random.split(key)
        s = np.sqrt(0.5)
        return jax.lax.complex(_normal(k1, self.shape, rdt) * s, _normal(k2, self.shape, rdt) * s)
    return _normal(key, self.shape, jdt).astype(jdt)


@lower(aten.normal_functional.default, random=True)
def normal_functional(self, mean=0.0, std=1.0, generator=None, *, key):
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        return randn_like(self, key=key) * std + mean
    return _normal(key, self.shape, self.dtype) * std + mean


@lower(aten.normal.Tensor_float, random=True)
def normal_tensor_float(mean, std=1.0, generator=None, *, key):
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    return _normal(key, mean.shape, mean.dtype) * std + mean


@lower(aten.normal.float_Tensor, random=True)
def normal_float_tensor(mean, std, generator=None, *, key):
    return _normal(key, std.shape, std.dtype) * std + mean


@lower(aten.normal.Tensor_Tensor, random=True)
def normal_tensor_tensor(mean, std, generator=None, *, key):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return _normal(key, shape, jnp.result_type(mean, std)) * std + mean


@lower(aten.normal.float_float, random=True)
def normal_float_float(mean, std, size, generator=None, dtype=None, layout=None, device=None, pin_memory=None, *, key):
    jdt = _jdt(dtype, dtypes.to_jax_dtype(torch.get_default_dtype()))
    return (_normal(key, tuple(size), jdt) * std + mean).astype(jdt)


# ----------------------------------------------------------------------------- bernoulli


@lower(aten.bernoulli.default, random=True)
def bernoulli(self, generator=None, *, key):
    return _uniform(key, self.shape, jnp.float32 if self.dtype != jnp.float64 else self.dtype) < self


@lower(aten.bernoulli.p, random=True)
def bernoulli_p(self, p=0.5, generator=None, *, key):
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    return _uniform(key, self.shape, jnp.float64 if self.dtype == jnp.float64 else jnp.float32) < p


@lower(aten.bernoulli.Tensor, random=True)
def bernoulli_tensor(self, p, generator=None, *, key):
    return _uniform(key, self.shape, jnp.float64 if p.dtype == jnp.float64 else jnp.float32) < p


# ----------------------------------------------------------------------------- integers


def _int_range_default(jdt):
    """random_() with no bounds: [0, 2**digits] for floats, [0, max] for integers."""
    jdt = jnp.dtype(jdt)
    if jdt == jnp.bool_:
        return 0, 2
    if jnp.issubdtype(jdt, jnp.floating):
        digits = {
            jnp.dtype(jnp.float16): 11,
            jnp.dtype(jnp.bfloat16): 8,
            jnp.dtype(jnp.float32): 24,
            jnp.dtype(jnp.float64): 53,
        }[jdt]
        return 0, 2**digits + 1
    return 0, int(jnp.iinfo(jdt).max) + 1


def _randint(key, shape, lo, hi, jdt):
    """Integers in [lo, hi), exact for any int64 range."""
    jdt = jnp.dtype(jdt)
    if hi <= lo:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={lo} >= to={hi}")
    span = hi - lo
    if span <= 2**63 - 1 and lo >= -(2**63) and hi <= 2**63 - 1:
        v = jax.random.randint(key, shape, lo, hi, dtype=jnp.int64)
    else:
        bits = jax.random.bits(key, shape, jnp.uint64)
        v = (lo + (bits % np.uint64(span)).astype(jnp.int64)) if span < 2**64 else bits.astype(jnp.int64)
    if jdt == jnp.bool_:
        return v != 0
    return v.astype(jdt)


@lower(aten.random.default, random=True)
def random_default(self, generator=None, *, key):
    lo, hi = _int_range_default(self.dtype)
    return _randint(key, self.shape, lo, hi, self.dtype)


@lower(aten.random.to, random=True)
def random_to(self, to, generator=None, *, key):
    return _randint(key, self.shape, 0, int(to), self.dtype)


def _random_from(self, lo, to=None, generator=None, *, key):
    if to is None:
        _, hi = _int_range_default(self.dtype)
        if jnp.issubdtype(self.dtype, jnp.integer) and jnp.dtype(self.dtype) == jnp.int64:
            hi = 2**63  # [from, int64 max]
    else:
        hi = int(to)
    return _randint(key, self.shape, int(lo), hi, self.dtype)


def _random_from_entry(self, *args, key, **kwargs):
    names = ["from", "to", "generator"]
    vals = {"to": None, "generator": None}
    vals.update(dict(zip(names, args)))
    vals.update(kwargs)
    return _random_from(self, vals["from"], vals["to"], key=key)


lower(aten.random.__getattr__("from"), random=True)(_random_from_entry)


@lower(aten.randint_like.default, aten.randint_like.generator, random=True)
def randint_like(
    self, high, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key
):
    return _randint(key, self.shape, 0, int(high), _jdt(dtype, self.dtype))


@lower(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, random=True)
def randint_like_low(
    self, low, high, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key
):
    return _randint(key, self.shape, int(low), int(high), _jdt(dtype, self.dtype))


# ----------------------------------------------------------------------------- other distributions


def _u_open(key, self):
    """Uniform in (0, 1): never exactly 0, so logs are finite."""
    dt = _sample_dtype(self.dtype)
    return jax.random.uniform(key, self.shape, dt, jnp.finfo(dt).tiny, 1.0)


@lower(aten.exponential.default, random=True)
def exponential(self, lambd=1.0, generator=None, *, key):
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    return -jnp.log(_u_open(key, self)) / lambd


@lower(aten.geometric.default, random=True)
def geometric(self, p, generator=None, *, key):
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")
    return jnp.ceil(jnp.log(_u_open(key, self)) / np.log1p(-p))


@lower(aten.log_normal.default, random=True)
def log_normal(self, mean=1.0, std=2.0, generator=None, *, key):
    if std <= 0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={std}")
    return jnp.exp(_normal(key, self.shape, self.dtype) * std + mean)


@lower(aten.cauchy.default, random=True)
def cauchy(self, median=0.0, sigma=1.0, generator=None, *, key):
    u = _uniform(key, self.shape, self.dtype)
    return median + sigma * jnp.tan(np.pi * (u - 0.5))


@lower(aten.multinomial.default, random=True)
def multinomial(self, num_samples, replacement=False, generator=None, *, key):
    p = self.astype(jnp.float64 if self.dtype == jnp.float64 else jnp.float32)
    n_cat = p.shape[-1]
    if not replacement and num_samples > n_cat:
        raise RuntimeError("multinomial: cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1)), -jnp.inf)
    if replacement:
        batch = p.shape[:-1]
        s = jax.random.categorical(key, logp[..., None, :], axis=-1, shape=batch + (num_samples,))
        return s.astype(jnp.int64)
    g = jax.random.gumbel(key, p.shape, p.dtype)
    _, idx = jax.lax.top_k(logp + g, num_samples)
    return idx.astype(jnp.int64)


# ----------------------------------------------------------------------------- bespoke handlers


def _inplace_from(functional):
    """In-place op whose functional variant has another name (normal_ -> normal_functional)."""

    def handler(args, kwargs):
        self = args[0]
        new = run(plan_for(functional), functional, args, kwargs)
        write_value(self, new)
        return self

    return handler


custom(aten.normal_.default)(_inplace_from(aten.normal_functional.default))


def _randperm_out(args, kwargs):
    from .. import random as tpu_random
    from .factory import write_out

    func = aten.randperm.generator_out if len(args) > 1 or "generator" in kwargs else aten.randperm.out
    b = bind(func, args, kwargs)
    out = b["out"]
    n = int(b["n"])
    if n < 0:
        raise RuntimeError(f"randperm: n must be non-negative, got {n}")
    index = storage_of(out).device_index if isinstance(out, TpuTensor) else 0
    key = jax.random.wrap_key_data(tpu_random.next_key_data(index))
    perm = _randperm_exe(n)(key)
    return write_out(out, perm)


_RANDPERM: dict = {}


def _randperm_exe(n):
    f = _RANDPERM.get(n)
    if f is None:
        f = _RANDPERM[n] = jax.jit(lambda key: jax.random.permutation(key, n).astype(jnp.int64))
    return f


custom(aten.randperm.out, aten.randperm.generator_out)(_randperm_out)
