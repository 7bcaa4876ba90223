"""nn activations and the *_backward ATen ops autograd calls for them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import torch

from ..registry import aten, lower
from .pointwise import cast, promote


def _f(*xs):
    """Promote to the common dtype, computing half types in float32."""
    arrs, dt = promote(*xs)
    return arrs


# ----------------------------------------------------------------------------- forward


@lower(aten.relu.default)
def relu(self):
    if self.dtype == jnp.bool_:
        return self
    return (
        jnp.where(self > 0, self, jnp.zeros_like(self))
        if not jnp.issubdtype(self.dtype, jnp.floating)
        else jnp.where(jnp.isnan(self) | (self > 0), self, jnp.zeros_like(self))
    )


@lower(aten.relu6.default)
def relu6(self):
    return hardtanh(self, 0.0, 6.0)


@lower(aten.hardtanh.default)
def hardtanh(self, min_val=-1, max_val=1):
    (x,) = _f(self)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.clip(x, jnp.asarray(min_val).astype(x.dtype), jnp.asarray(max_val).astype(x.dtype))
    return jnp.minimum(jnp.maximum(x, min_val), max_val)


@lower(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output, self, min_val, max_val):
    g, x = _f(grad_output, self)
    return jnp.where((x <= min_val) | (x >= max_val), jnp.zeros_like(g), g)


@lower(aten.leaky_relu.default)
def leaky_relu(self, negative_slope=0.01):
    (x,) = _f(self)
    return jnp.where(x > 0, x, x * negative_slope)


@lower(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    g, x = _f(grad_output, self)
    return jnp.where(x > 0, g, g * negative_slope)


@lower(aten.elu.default)
def elu(self, alpha=1, scale=1, input_scale=1):
    (x,) = _f(self)
    neg = jnp.expm1(jnp.minimum(x, 0) * input_scale) * alpha * scale
    return jnp.where(x > 0, x * scale, neg)


@lower(aten.elu_backward.default)
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    g, y = _f(grad_output, self_or_result)
    if is_result:
        neg = g * input_scale * (y + alpha * scale)
    else:
        neg = g * input_scale * alpha * scale * jnp.exp(jnp.minimum(y, 0) * input_scale)
    return jnp.where(y > 0, g * scale, neg)


@lower(aten.celu.default)
def celu(self, alpha=1.0):
    return elu(self, alpha, 1.0, 1.0 / alpha)


@lower(aten.selu.default)
def selu(self):
    return elu(self, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946, 1.0)


_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@lower(aten.gelu.default, static=("approximate",))
def gelu(self, approximate="none"):
    (x,) = _f(self)
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return 0.5 * x * (1 + jss.erf(x / _SQRT_2))


@lower(aten.gelu_backward.default, static=("approximate",))
def gelu_backward(grad_output, self, approximate="none"):
    g, x = _f(grad_output, self)
    if approximate == "tanh":
        x3 = x * x * x
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * x3)
        t = jnp.tanh(inner)
        left = 0.5 * x
        right = 1 + t
        left_d = 0.5 * right
        dinner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
        right_d = left * (1 - t * t) * dinner
        return g * (left_d + right_d)
    cdf = 0.5 * (1 + jss.erf(x / _SQRT_2))
    pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return g * (cdf + x * pdf)


@lower(aten.silu.default)
def silu(self):
    (x,) = _f(self)
    return x * jax.nn.sigmoid(x)


@lower(aten.silu_backward.default)
def silu_backward(grad_output, self):
    g, x = _f(grad_output, self)
    s = jax.nn.sigmoid(x)
    return g * s * (1 + x * (1 - s))


@lower(aten.mish.default)
def mish(self):
    (x,) = _f(self)
    return x * jnp.tanh(jax.nn.softplus(x))


@lower(aten.mish_backward.default)
def mish_backward(grad_output, self):
    g, x = _f(grad_output, self)
    s = jax.nn.sigmoid(x)
    sp = jax.nn.softplus(x)
    # 1 - tanh(sp)^2 as 1 / cosh(sp)^2: no cancellation where tanh(sp) nears 1
    return g * (jnp.tanh(sp) + x * s / jnp.square(jnp.cosh(sp)))


@lower(aten.hardswish.default)
def hardswish(self):
    (x,) = _f(self)
    return x * jnp.clip(x + 3, 0, 6) / 6


@lower(aten.hardswish_backward.default)
def hardswish_backward(grad_output, self):
    g, x = _f(grad_output, self)
    # PyTorch's boundaries: 0 at x = -3, the identity's 1 at x = 3
    return jnp.where(x <= -3, 0.0, jnp.where(x < 3, g * ((x / 3) + 0.5), g))


@lower(aten.hardsigmoid.default)
def hardsigmoid(self):
    (x,) = _f(self)
    return jnp.clip(x + 3, 0, 6) / 6


@lower(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad_output, self):
    g, x = _f(grad_output, self)
    return jnp.where((x > -3) & (x < 3), g / 6, 0.0)


@lower(aten.softplus.default)
def softplus(self, beta=1, threshold=20):
    (x,) = _f(self)
    xb = x * beta
    return jnp.where(xb > threshold, x, jnp.log1p(jnp.exp(jnp.minimum(xb, threshold))) / beta)


@lower(aten.softplus_backward.default)
def softplus_backward(grad_output, self, beta, threshold):
    g, x = _f(grad_output, self)
    xb = x * beta
    z = jnp.exp(jnp.minimum(xb, threshold))
    return jnp.where(xb > threshold, g, g * z / (z + 1))


@lower(aten.softshrink.default)
def softshrink(self, lambd=0.5):
    (x,) = _f(self)
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, jnp.zeros_like(x)))


@lower(aten.softshrink_backward.default)
def softshrink_backward(grad_output, self, lambd):
    g, x = _f(grad_output, self)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(g), g)


@lower(aten.hardshrink.default)
def hardshrink(self, lambd=0.5):
    (x,) = _f(self)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(x), x)


@lower(aten.hardshrink_backward.default)
def hardshrink_backward(grad_out, self, lambd):
    g, x = _f(grad_out, self)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(g), g)


@lower(aten.threshold.default)
def threshold(self, threshold, value):
    (x,), _ = promote(self, opmath=False)
    return jnp.where(x <= threshold, cast(value, torch_dtype_of(x)), x)


def torch_dtype_of(x):
    from .. import dtypes

    return dtypes.to_torch_dtype(x.dtype)


@lower(aten.threshold_backward.default)
def threshold_backward(grad_output, self, threshold):
    g, x = _f(grad_output, self)
    return jnp.where(x <= threshold, jnp.zeros_like(g), g)


@lower(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self):
    (x,) = _f(self)
    mn = jnp.minimum(x, 0)
    z = jnp.exp(-jnp.abs(x))
    return mn - jnp.log1p(z), z


@lower(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad_output, self, buffer):
    g, x = _f(grad_output, self)
    return g * jax.nn.sigmoid(-x)


@lower(aten.sigmoid_backward.default)
def sigmoid_backward(grad_output, output):
    g, y = _f(grad_output, output)
    if jnp.iscomplexobj(y):
        y = jnp.conj(y)
    return g * (1 - y) * y


@lower(aten.tanh_backward.default)
def tanh_backward(grad_output, output):
    g, y = _f(grad_output, output)
    if jnp.iscomplexobj(y):
        y = jnp.conj(y)
    return g * (1 - y * y)


@lower(aten.logit_backward.default)
def logit_backward(grad_output, self, eps=None):
    g, x = _f(grad_output, self)
    d = g / (x * (1 - x))
    if eps is None:
        return jnp.where((x < 0) | (x > 1), jnp.nan, d)
    return jnp.where((x < eps) | (x > 1 - eps), jnp.zeros_like(g), d)


@lower(aten.glu.default, static=("dim",))
def glu(self, dim=-1):
    (x,) = _f(self)
    a, b = jnp.split(x, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@lower(aten.glu_backward.default, static=("dim",))
def glu_backward(grad_output, self, dim):
    g, x = _f(grad_output, self)
    a, b = jnp.split(x, 2, axis=dim)
    s = jax.nn.sigmoid(b)
    return jnp.concatenate([g * s, g * a * s * (1 - s)], axis=dim)


@lower(aten._prelu_kernel.default)
def _prelu_kernel(self, weight):
    x, w = _f(self, weight)
    return jnp.where(x > 0, x, w * x)


@lower(aten._prelu_kernel_backward.default)
def _prelu_kernel_backward(grad_output, self, weight):
    g, x, w = _f(grad_output, self, weight)
    gi = jnp.where(x > 0, g, w * g)
    gw = jnp.where(x > 0, jnp.zeros_like(g), x * g)
    return gi, gw


@lower(aten.rrelu_with_noise.default, aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise(self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None, *, key=None):
    # mutates `noise`: returns (output, new noise)
    (x,) = _f(self)
    if not training:
        return jnp.where(x >= 0, x, x * ((lower + upper) / 2)), noise
    r = jax.random.uniform(key, x.shape, x.dtype, lower, upper)
    return jnp.where(x >= 0, x, x * r), jnp.where(x >= 0, 1.0, r).astype(noise.dtype)


@lower(aten.rrelu_with_noise_backward.default)
def rrelu_with_noise_backward(grad_output, self, noise, lower, upper, training, self_is_result):
    g, x = _f(grad_output, self)
    eval_grad = jnp.where(x > 0, g, g * ((lower + upper) / 2))
    if training:
        return jnp.where(upper - lower > 1e-6, g * noise, eval_grad)
    return eval_grad


# ----------------------------------------------------------------------------- zero tensors
# Autograd formulas for ops with zero derivative (sgn, sign, ...) create their result with
# the factory `_efficientzerotensor`, which has no tensor argument to dispatch on.

_ZERO_LIB = None


def _efficientzerotensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    return torch.zeros(tuple(size), dtype=dtype or torch.get_default_dtype(), device=device)


def _register_zero_tensor():
    global _ZERO_LIB
    try:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_efficientzerotensor", _efficientzerotensor, "PrivateUse1")
        _ZERO_LIB = lib
    except RuntimeError:
        pass  # registered elsewhere already


_register_zero_tensor()


# ----------------------------------------------------------------------------- silu's and mish's backward
# aten.silu_backward and aten.mish_backward have composite (CompositeImplicitAutograd) forms,
# which the dispatcher runs under autograd before the tpu kernel is reached: on tpu their
# backward then ran as its pieces (sigmoid, tanh, 1 - s, x * ..., ...), each rounded to a half
# type's precision, where PyTorch's CPU and CUDA kernels compute it in float32 and round once
# (bfloat16 silu gradients 18% off near x = -1.28, where 1 + x(1 - s) cancels; mish's up to
# hundreds of bfloat16 ulps). The autograd kernels below run the op itself (the lowerings above,
# in float32) and differentiate it for a double backward.


class _Float32Backward(torch.autograd.Function):
    """An activation's backward op `OP` (grad_output, x) run below autograd (its tpu lowering),
    with `_derivatives` giving its own gradients for a double backward."""

    OP = None

    @classmethod
    def forward(cls, ctx, grad_output, x):
        ctx.save_for_backward(grad_output, x)
        with torch._C._AutoDispatchBelowAutograd():
            return cls.OP(grad_output, x)

    @classmethod
    def backward(cls, ctx, gg):
        return cls._derivatives(gg, *ctx.saved_tensors)


class _SiluBackward(_Float32Backward):
    OP = torch.ops.aten.silu_backward

    @staticmethod
    def _derivatives(gg, g, x):
        # d/dg and d/dx of g * s * (1 + x (1 - s)), s = sigmoid(x)
        s = torch.sigmoid(x)
        dg = gg * s * (1 + x * (1 - s))
        dx = gg * g * s * (1 - s) * (2 + x * (1 - 2 * s))
        return dg, dx


class _MishBackward(_Float32Backward):
    OP = torch.ops.aten.mish_backward

    @staticmethod
    def _derivatives(gg, g, x):
        # d/dg and d/dx of g * (t + x s (1 - t^2)), s = sigmoid(x), t = tanh(softplus(x)),
        # dt/dx = u = s (1 - t^2) = s / cosh(softplus(x))^2
        s = torch.sigmoid(x)
        sp = torch.nn.functional.softplus(x)
        t = torch.tanh(sp)
        u = s / torch.cosh(sp).square()
        dg = gg * (t + x * u)
        dx = gg * g * u * (2 + x * ((1 - s) - 2 * t * s))
        return dg, dx


_FLOAT32_BACKWARD_LIB = None


def _register_float32_backwards():
    global _FLOAT32_BACKWARD_LIB
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("silu_backward", _SiluBackward.apply, "AutogradPrivateUse1")
    lib.impl("mish_backward", _MishBackward.apply, "AutogradPrivateUse1")
    _FLOAT32_BACKWARD_LIB = lib


_register_float32_backwards()
