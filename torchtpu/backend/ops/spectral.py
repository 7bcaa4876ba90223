"""Spectral ops: the three ATen FFT primitives every torch.fft function reduces to.

- _fft_c2c: complex -> complex over `dim`, forward or inverse;
- _fft_r2c: real -> complex, the last of `dim` halved when `onesided`;
- _fft_c2r: complex (onesided) -> real, the last of `dim` restored to `last_dim_size`.

ATen passes the scaling explicitly: `normalization` is 0 (none), 1 (1/sqrt(n)) or 2 (1/n),
with n the product of the signal sizes over `dim`, whatever the direction. The transforms
below are therefore unnormalized and the scale is applied once at the end.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..registry import aten, lower

_NORM_NONE, _NORM_BY_ROOT_N, _NORM_BY_N = 0, 1, 2


def _dims(dim, ndim):
    return [d + ndim if d < 0 else d for d in dim]


def _scale(x, normalization, n):
    if normalization == _NORM_NONE or n <= 1:
        return x
    if normalization == _NORM_BY_ROOT_N:
        return x * jnp.asarray(1.0 / math.sqrt(n), dtype=x.real.dtype)
    if normalization == _NORM_BY_N:
        return x * jnp.asarray(1.0 / n, dtype=x.real.dtype)
    raise ValueError(f"torchtpu: FFT normalization mode {normalization} is not one of 0, 1, 2")


def _complex_dtype(dtype):
    return jnp.complex128 if dtype in (jnp.float64, jnp.complex128) else jnp.complex64


def _c2c_unnormalized(x, dims, forward):
    for d in dims:
        if x.shape[d] == 0:
            continue
        if forward:
            x = jnp.fft.fft(x, axis=d)
        else:
            # inverse without its 1/n: the caller applies the requested normalization
            x = jnp.fft.ifft(x, axis=d, norm="forward")
    return x


@lower(aten._fft_c2c.default)
def fft_c2c(self, dim, normalization, forward):
    x = self.astype(_complex_dtype(self.dtype))
    dims = _dims(dim, x.ndim)
    out = _c2c_unnormalized(x, dims, forward)
    return _scale(out, normalization, math.prod(x.shape[d] for d in dims))


@lower(aten._fft_r2c.default)
def fft_r2c(self, dim, normalization, onesided):
    dims = _dims(dim, self.ndim)
    real_dtype = jnp.float64 if self.dtype == jnp.float64 else jnp.float32
    x = self.astype(real_dtype)
    n = math.prod(x.shape[d] for d in dims)
    if not dims:
        return x.astype(_complex_dtype(real_dtype))
    last = dims[-1]
    if onesided:
        if x.shape[last] == 0:
            out = jnp.zeros(x.shape, _complex_dtype(real_dtype))
        else:
            out = jnp.fft.rfft(x, axis=last)
        out = _c2c_unnormalized(out, dims[:-1], True)
    else:
        out = _c2c_unnormalized(x.astype(_complex_dtype(real_dtype)), dims, True)
    return _scale(out, normalization, n)


@lower(aten._fft_c2r.default)
def fft_c2r(self, dim, normalization, last_dim_size):
    x = self.astype(_complex_dtype(self.dtype))
    dims = _dims(dim, x.ndim)
    if not dims:
        return jnp.real(x)
    last = dims[-1]
    x = _c2c_unnormalized(x, dims[:-1], False)
    # irfft reads the first last_dim_size // 2 + 1 bins (zero padded if fewer); the
    # imaginary parts of the DC and Nyquist bins are ignored, as in PyTorch.
    out = jnp.fft.irfft(x, n=last_dim_size, axis=last, norm="forward")
    n = math.prod(x.shape[d] for d in dims[:-1]) * last_dim_size
    return _scale(out, normalization, n)
