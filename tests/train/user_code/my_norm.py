"""A user's module for `[experimental] custom_import` (tests/train/test_custom_import.py): RMS norm as a
JAX function with a hand-written gradient (jax.custom_vjp), made a torch op with torchtpu.jax_op, and a
model family "llama3_my_norm" that is torchtitan's Llama 3 with every nn.RMSNorm running that op.

Written as a user would, against the public API only. TRACED records the traces of the forward and
the backward, so a test can tell the op ran."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import torch

import torchtpu
from torchtpu.models.registry import get_family, register_family

TRACED = []


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _fwd(x, w, eps):
    TRACED.append("forward")
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w, (x, w, r)


def _bwd(eps, res, g):
    TRACED.append("backward")
    x, w, r = res
    n = x * r
    gn = g * w
    dx = r * (gn - n * jnp.mean(gn * n, axis=-1, keepdims=True))
    dw = jnp.sum(g * n, axis=tuple(range(g.ndim - 1)))
    return dx, dw


rms_norm.defvjp(_fwd, _bwd)


def _norm(x, w, eps: float = 1e-5):
    return rms_norm(x, w, eps)


my_rms_norm = torchtpu.jax_op("my_norm::rms_norm", _norm)


class MyRMSNorm(torch.nn.RMSNorm):
    def forward(self, x):
        return my_rms_norm(x, self.weight, self.eps)


def use_my_norm(model):
    """Llama 3 prepared for tpu as the built-in family is, then every RMSNorm running my_rms_norm."""
    model = get_family("llama3").prepare(model)
    for m in model.modules():
        if type(m) is torch.nn.RMSNorm:
            m.__class__ = MyRMSNorm
    return model


register_family(dataclasses.replace(get_family("llama3"), name="llama3_my_norm", preparer="my_norm:use_my_norm"))
