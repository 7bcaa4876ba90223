"""Elementwise ops. Inputs are promoted the way PyTorch promotes them before computing."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..registry import aten, lower


@lower(aten.add.Tensor, aten.add.Scalar)
def add(self, other, alpha=1):
    if not isinstance(alpha, (int, float)) or alpha != 1:
        other = other * alpha
    return jnp.add(self, other)


@lower(aten.sub.Tensor, aten.sub.Scalar)
def sub(self, other, alpha=1):
    if not isinstance(alpha, (int, float)) or alpha != 1:
        other = other * alpha
    return jnp.subtract(self, other)


@lower(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    return jnp.multiply(self, other)


@lower(aten.fill.Scalar, aten.fill.Tensor)
def fill(self, value):
    return jnp.full(self.shape, value, self.dtype)


@lower(aten.zero.default)
def zero(self):
    return jnp.zeros_like(self)
