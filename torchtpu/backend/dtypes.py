"""The one mapping between torch and JAX dtypes."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

TORCH_TO_JAX = {
    torch.float32: jnp.dtype(jnp.float32),
    torch.float64: jnp.dtype(jnp.float64),
    torch.float16: jnp.dtype(jnp.float16),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int64: jnp.dtype(jnp.int64),
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.uint16: jnp.dtype(jnp.uint16),
    torch.uint32: jnp.dtype(jnp.uint32),
    torch.uint64: jnp.dtype(jnp.uint64),
    torch.bool: jnp.dtype(jnp.bool_),
    torch.complex64: jnp.dtype(jnp.complex64),
    torch.complex128: jnp.dtype(jnp.complex128),
    torch.float8_e4m3fn: jnp.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: jnp.dtype(ml_dtypes.float8_e5m2),
}
JAX_TO_TORCH = {v: k for k, v in TORCH_TO_JAX.items()}


def to_jax_dtype(dtype: torch.dtype):
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"torchtpu has no JAX equivalent for {dtype}") from None


def to_torch_dtype(dtype) -> torch.dtype:
    try:
        return JAX_TO_TORCH[jnp.dtype(dtype)]
    except KeyError:
        raise TypeError(f"torchtpu has no torch equivalent for JAX dtype {dtype}") from None


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy view of a CPU tensor as numpy, including bfloat16 and float8."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        carrier = torch.int16 if t.dtype == torch.bfloat16 else torch.int8
        return t.contiguous().view(carrier).numpy().view(TORCH_TO_JAX[t.dtype])
    return t.numpy()


def numpy_to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    a = np.asarray(a)
    if not a.flags.writeable:
        a = a.copy()
    if dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        carrier = np.int16 if dtype == torch.bfloat16 else np.int8
        return torch.from_numpy(np.ascontiguousarray(a).view(carrier)).view(dtype)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)
