"""Normalisation layers: layer norm, group norm, RMS norm, batch norm (+ backward).

Statistics are computed in float32 for low-precision inputs (as PyTorch's CPU kernels do).
Backward ops are VJPs of the forward lowerings. Batch norm's running statistics follow
PyTorch exactly: new = (1 - momentum) * old + momentum * batch_stat, with the *unbiased*
batch variance.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from jax import lax

from .. import dtypes
from ..registry import aten, lower
from . import rms_norm_tpu

_LOW = (jnp.bfloat16, jnp.float16)


def _acc(x):
    return x.astype(jnp.float32) if x.dtype in _LOW else x


# ----------------------------------------------------------------------------- layer norm


def _norm_axes(ndim, normalized_shape):
    """(normalized axes, batch axes) of an `ndim`-dim input: its last len(normalized_shape) dims, and those before."""
    k = len(normalized_shape)
    return tuple(range(ndim - k, ndim)), tuple(range(ndim - k))


def _layer_norm(input, normalized_shape, weight, bias, eps):
    x = _acc(input)
    axes, _ = _norm_axes(x.ndim, normalized_shape)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * _acc(weight)
    if bias is not None:
        out = out + _acc(bias)
    return out.astype(input.dtype), mean, rstd


@lower(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    out, mean, rstd = _layer_norm(input, normalized_shape, weight, bias, eps)
    return out, mean.astype(_stat_dtype(input)), rstd.astype(_stat_dtype(input))


def _stat_dtype(x):
    return x.dtype


@lower(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes, batch_axes = _norm_axes(input.ndim, normalized_shape)
    x = _acc(input)
    g = _acc(grad_out)
    mean = _acc(mean)
    rstd = _acc(rstd)
    xhat = (x - mean) * rstd
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * _acc(weight) if weight is not None else g
        n = math.prod(normalized_shape)
        a = jnp.sum(gx, axis=axes, keepdims=True) / n
        b = jnp.sum(gx * xhat, axis=axes, keepdims=True) / n
        gi = (rstd * (gx - a - xhat * b)).astype(input.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(g * xhat, axis=batch_axes).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        gb = jnp.sum(g, axis=batch_axes).astype(bias.dtype)
    return gi, gw, gb


# ----------------------------------------------------------------------------- RMS norm


def _rms_norm(input, normalized_shape, weight, eps):
    x = _acc(input)
    axes, _ = _norm_axes(x.ndim, normalized_shape)
    rstd = lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + eps)
    out = x * rstd
    if weight is not None:
        out = out * _acc(weight)
    return out.astype(input.dtype), rstd


def _on_tpu(kernel, xla, operands):
    """`kernel` when the program is compiled for TPU (or anywhere inside
    attention_tpu.interpret_kernels()), else `xla` (rms_norm_tpu's module doc)."""
    if rms_norm_tpu.interpreting():
        return kernel(*operands)
    return lax.platform_dependent(*operands, tpu=kernel, default=xla)


def _default_eps(input, eps):
    """PyTorch's eps when none is given: that of the dtype the statistics are computed in."""
    return float(jnp.finfo(_acc(input).dtype).eps) if eps is None else eps


@lower(aten._fused_rms_norm.default)
def _fused_rms_norm(input, normalized_shape, weight, eps=None):
    eps = _default_eps(input, eps)
    if rms_norm_tpu.unsupported_reason(input, normalized_shape) is not None:
        return _rms_norm(input, normalized_shape, weight, eps)
    operands = (input,) + ((weight,) if weight is not None else ())

    def kernel(x, *w):
        return rms_norm_tpu.forward(x, w[0] if w else None, eps)

    def xla(x, *w):
        return _rms_norm(x, normalized_shape, w[0] if w else None, eps)

    return _on_tpu(kernel, xla, operands)


@lower(aten._fused_rms_norm_backward.default)
def _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    if rms_norm_tpu.unsupported_reason(input, normalized_shape) is not None:
        return _rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask)
    operands = (grad_out, input, rstd) + ((weight,) if weight is not None else ())

    def kernel(g, x, r, *w):
        gi, gw = rms_norm_tpu.backward(g, x, r, w[0] if w else None)
        return gi, (gw.astype(w[0].dtype) if w else None)

    def xla(g, x, r, *w):
        return _rms_norm_backward(g, x, normalized_shape, r, w[0] if w else None, (True, bool(w)))

    gi, gw = _on_tpu(kernel, xla, operands)
    return gi if output_mask[0] else None, gw if output_mask[1] else None


def _rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    axes, batch_axes = _norm_axes(input.ndim, normalized_shape)
    x = _acc(input)
    g = _acc(grad_out)
    r = _acc(rstd)
    gi = gw = None
    if output_mask[0]:
        gx = g * _acc(weight) if weight is not None else g
        n = math.prod(normalized_shape)
        dot = jnp.sum(gx * x, axis=axes, keepdims=True) / n
        gi = (r * gx - x * (r**3) * dot).astype(input.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(g * x * r, axis=batch_axes).astype(weight.dtype)
    return gi, gw


class _RmsNorm(torch.autograd.Function):
    """`aten.rms_norm` on tpu as its fused op and that op's backward, as CUDA runs it (the op is
    CompositeImplicitAutograd, which would otherwise run it as pow, mean, rsqrt and products,
    and its backward as theirs). The arithmetic is the fused decomposition's: float32
    statistics, the weight applied in float32, one rounding."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight, eps):
        with torch._C._AutoDispatchBelowAutograd():
            out, rstd = torch.ops.aten._fused_rms_norm(input, normalized_shape, weight, eps)
        ctx.save_for_backward(input, weight, rstd)
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        return out

    @staticmethod
    def backward(ctx, grad):
        input, weight, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
        if torch.is_grad_enabled():  # create_graph: a backward that is itself differentiable
            return (*_differentiable_backward(grad, input, weight, ctx.normalized_shape, ctx.eps, mask),)
        with torch._C._AutoDispatchBelowAutograd():
            gi, gw = torch.ops.aten._fused_rms_norm_backward(grad, input, ctx.normalized_shape, rstd, weight, mask)
        return gi, None, gw, None


def _differentiable_backward(grad, input, weight, normalized_shape, eps, mask):
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    x = input.float() if input.dtype in (torch.bfloat16, torch.float16) else input
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    r = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    g = grad.to(x.dtype)
    gx = g * weight.to(x.dtype) if weight is not None else g
    gi = gw = None
    if mask[0]:
        gi = (r * gx - x * r.pow(3) * (gx * x).mean(dims, keepdim=True)).to(input.dtype)
    if mask[1]:
        batch = tuple(range(input.dim() - len(normalized_shape)))
        gw = (g * x * r).sum(batch).to(weight.dtype)
    return gi, None, gw, None


def _rms_norm_autograd(input, normalized_shape, weight=None, eps=None):
    if torch._C._are_functorch_transforms_active():
        # torch.func (grad, vmap, jvp, ...) transforms PyTorch's composite rms_norm op by op; an
        # autograd.Function needs rules of its own for each transform
        return aten.rms_norm.default.decompose(input, normalized_shape, weight, eps)
    return _RmsNorm.apply(input, list(normalized_shape), weight, eps)


_RMS_NORM_LIB = torch.library.Library("aten", "IMPL")
_RMS_NORM_LIB.impl("rms_norm", _rms_norm_autograd, "AutogradPrivateUse1")


# ----------------------------------------------------------------------------- group norm


def _group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = _acc(input).reshape(N, group, -1)
    mean = jnp.mean(x, axis=2)
    var = jnp.mean(jnp.square(x - mean[..., None]), axis=2)
    rstd = lax.rsqrt(var + eps)
    out = ((x - mean[..., None]) * rstd[..., None]).reshape(N, C, -1)
    if weight is not None:
        out = out * _acc(weight).reshape(1, C, 1)
    if bias is not None:
        out = out + _acc(bias).reshape(1, C, 1)
    return out.reshape(input.shape).astype(input.dtype), mean, rstd


@lower(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    out, mean, rstd = _group_norm(input, weight, bias, N, C, HxW, group, eps)
    return out, mean.astype(input.dtype), rstd.astype(input.dtype)


@lower(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    x = _acc(input).reshape(N, group, -1)
    g = _acc(grad_out).reshape(N, C, -1)
    mean = _acc(mean).reshape(N, group, 1)
    rstd = _acc(rstd).reshape(N, group, 1)
    xhat = (x - mean) * rstd  # (N, G, C/G*HxW)
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * _acc(weight).reshape(1, C, 1) if weight is not None else g
        gx = gx.reshape(N, group, -1)
        m = gx.shape[2]
        a = jnp.sum(gx, axis=2, keepdims=True) / m
        b = jnp.sum(gx * xhat, axis=2, keepdims=True) / m
        gi = (rstd * (gx - a - xhat * b)).reshape(input.shape).astype(input.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(g * xhat.reshape(N, C, -1), axis=(0, 2)).astype(weight.dtype)
    if output_mask[2]:
        gb = jnp.sum(g, axis=(0, 2)).astype(grad_out.dtype)
    return gi, gw, gb


# ----------------------------------------------------------------------------- batch norm


def _bshape(x):
    return (1, -1) + (1,) * (x.ndim - 2)


def _bn_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _bn_train(input, weight, bias, eps):
    """Normalise with the batch statistics: (out, mean, invstd, biased var)."""
    x = _acc(input)
    axes = _bn_axes(x)
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - mean.reshape(_bshape(x))), axis=axes)
    invstd = lax.rsqrt(var + eps)
    out = _affine((x - mean.reshape(_bshape(x))) * invstd.reshape(_bshape(x)), weight, bias)
    return out.astype(input.dtype), mean, invstd, var


def _bn_eval(input, weight, bias, running_mean, running_var, eps):
    x = _acc(input)
    invstd = lax.rsqrt(_acc(running_var) + eps)
    out = _affine((x - _acc(running_mean).reshape(_bshape(x))) * invstd.reshape(_bshape(x)), weight, bias)
    return out.astype(input.dtype)


def _affine(y, weight, bias):
    if weight is not None:
        y = y * _acc(weight).reshape(_bshape(y))
    if bias is not None:
        y = y + _acc(bias).reshape(_bshape(y))
    return y


def _updated_stats(input, mean, var, running_mean, running_var, momentum):
    n = input.size // input.shape[1] if input.shape[1] else 0
    unbiased = var * (n / (n - 1)) if n > 1 else var * jnp.inf
    new_rm = new_rv = None
    if running_mean is not None:
        new_rm = ((1 - momentum) * _acc(running_mean) + momentum * mean).astype(running_mean.dtype)
    if running_var is not None:
        new_rv = ((1 - momentum) * _acc(running_var) + momentum * unbiased).astype(running_var.dtype)
    return new_rm, new_rv


def _empty_like_stats(input):
    return jnp.zeros((0,), input.dtype)


@lower(aten._native_batch_norm_legit_functional.default)
def _native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        out, mean, invstd, var = _bn_train(input, weight, bias, eps)
        new_rm, new_rv = _updated_stats(input, mean, var, running_mean, running_var, momentum)
        return out, mean, invstd, new_rm, new_rv
    # PyTorch's meta kernel says (C,) statistics in eval mode (its CPU kernel returns empty
    # ones; the custom handlers below reproduce that).
    out = _bn_eval(input, weight, bias, running_mean, running_var, eps)
    invstd = lax.rsqrt(_acc(running_var) + eps)
    return out, _acc(running_mean), invstd, running_mean, running_var


@lower(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    if not training:
        raise RuntimeError(
            "torchtpu: _native_batch_norm_legit.no_stats with training=False needs running statistics; "
            "pass running_mean/running_var or use training=True"
        )
    out, mean, invstd, _ = _bn_train(input, weight, bias, eps)
    return out, mean, invstd


@lower(aten._native_batch_norm_legit_no_training.default)
def _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    out = _bn_eval(input, weight, bias, running_mean, running_var, eps)
    return out, _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)


@lower(aten._batch_norm_with_update_functional.default)
def _batch_norm_with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, invstd, var = _bn_train(input, weight, bias, eps)
    new_rm, new_rv = _updated_stats(input, mean, var, running_mean, running_var, momentum)
    return out, mean, invstd, jnp.zeros((0,), jnp.uint8), new_rm, new_rv


@lower(aten._batch_norm_with_update.default)
def _batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm_with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps)


@lower(aten._batch_norm_no_update.default)
def _batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    if running_mean is None or running_var is None:
        out, mean, invstd, _ = _bn_train(input, weight, bias, eps)
        return out, mean, invstd, jnp.zeros((0,), jnp.uint8)
    out = _bn_eval(input, weight, bias, running_mean, running_var, eps)
    return out, _empty_like_stats(input), _empty_like_stats(input), jnp.zeros((0,), jnp.uint8)


def _bn_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    x = _acc(input)
    g = _acc(grad_out)
    axes = _bn_axes(x)
    bs = _bshape(x)
    if train:
        mean = _acc(save_mean)
        invstd = _acc(save_invstd)
    else:
        mean = _acc(running_mean)
        invstd = lax.rsqrt(_acc(running_var) + eps)
    xhat = (x - mean.reshape(bs)) * invstd.reshape(bs)
    gsum = jnp.sum(g, axis=axes)
    dot = jnp.sum(g * xhat, axis=axes)
    w = _acc(weight) if weight is not None else jnp.ones_like(mean)
    gi = gw = gb = None
    if output_mask[0]:
        if train:
            n = x.size // x.shape[1]
            gi = (g - (gsum / n).reshape(bs) - xhat * (dot / n).reshape(bs)) * (invstd * w).reshape(bs)
        else:
            gi = g * (invstd * w).reshape(bs)
        gi = gi.astype(input.dtype)
    if output_mask[1]:
        gw = dot.astype(weight.dtype if weight is not None else input.dtype)
    if output_mask[2]:
        gb = gsum.astype(weight.dtype if weight is not None else input.dtype)
    return gi, gw, gb


@lower(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    return _bn_backward(
        grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
    )


@lower(aten.batch_norm_backward.default)
def batch_norm_backward(
    grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask, reserve
):
    train = update or running_mean is None
    return _bn_backward(
        grad_out, input, weight, running_mean, running_var, save_mean, save_var, train, eps, output_mask
    )


# native_batch_norm mutates running_mean / running_var without saying so in its schema:
# compute functionally, then write the new statistics back into those tensors. The eval-mode
# statistics outputs are empty tensors, as PyTorch's CPU kernels return them.


def _install_batch_norm_handlers():
    from .. import registry as D

    fop = aten._native_batch_norm_legit_functional.default
    no_stats = aten._native_batch_norm_legit.no_stats

    def _empty(input, index):
        dt = torch.float32 if input.dtype in (torch.bfloat16, torch.float16) else input.dtype
        return D.wrap(jnp.zeros((0,), dtypes.to_jax_dtype(dt)), index)

    def _bn(args, kwargs, names):
        vals = dict(zip(names, args))
        vals.update(kwargs)
        index = D.device_index_of(args, kwargs)
        input = vals["input"]
        rm, rv = vals.get("running_mean"), vals.get("running_var")
        training = vals.get("training", False)
        momentum, eps = vals.get("momentum", 0.1), vals.get("eps", 1e-5)
        if rm is None or rv is None:
            if not training:
                raise RuntimeError("torchtpu: batch norm with training=False needs running_mean and running_var")
            out = D.run(
                D.plan_for(no_stats), no_stats, [input, vals.get("weight"), vals.get("bias"), True, momentum, eps], {}
            )
            return D.wrap(tuple(out), index)
        out = list(
            D.run(
                D.plan_for(fop),
                fop,
                [input, vals.get("weight"), vals.get("bias"), rm, rv, bool(training), momentum, eps],
                {},
            )
        )
        if training:
            D.write_value(rm, out[3])
            D.write_value(rv, out[4])
            return D.wrap(tuple(out[:3]), index)
        return (D.wrap(out[0], index), _empty(input, index), _empty(input, index))

    names = ["input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"]
    D.custom(aten.native_batch_norm.default, aten._native_batch_norm_legit.default)(
        lambda args, kwargs: _bn(args, kwargs, names)
    )
    nt_names = ["input", "weight", "bias", "running_mean", "running_var", "momentum", "eps"]
    D.custom(aten._native_batch_norm_legit_no_training.default)(lambda args, kwargs: _bn(args, kwargs, nt_names))


_install_batch_norm_handlers()
