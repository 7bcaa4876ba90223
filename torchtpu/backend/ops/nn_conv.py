"""Convolutions (plain and transposed, any spatial rank) and their backward.

The forward is one `lax.conv_general_dilated`; the backward is the VJP of that same
lowering, so the two always agree. Low-precision inputs accumulate in float32 like
PyTorch's CPU kernels and are cast back by the dispatcher.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..registry import aten, lower

_LOW = (jnp.bfloat16, jnp.float16)


def _spatial_names(n):
    return "".join("DHW"[3 - n :]) if n <= 3 else "".join(chr(ord("a") + i) for i in range(n))


def _dims(n):
    s = _spatial_names(n)
    return ("NC" + s, "OI" + s, "NC" + s)


def _expand(v, n):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _precision(x):
    return lax.Precision.HIGHEST


def conv_forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    n = weight.ndim - 2
    stride, padding, dilation = _expand(stride, n), _expand(padding, n), _expand(dilation, n)
    output_padding = _expand(output_padding or [0], n)
    out_dtype = input.dtype
    pref = jnp.float32 if input.dtype in _LOW else None
    if input.dtype != weight.dtype:
        dt = jnp.promote_types(input.dtype, weight.dtype)
        input, weight = input.astype(dt), weight.astype(dt)
    if not transposed:
        out = lax.conv_general_dilated(
            input,
            weight,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=_dims(n),
            feature_group_count=groups,
            precision=_precision(input),
            preferred_element_type=pref,
        )
    else:
        # weight is (C_in, C_out/groups, k...): a conv over the stride-dilated input with the
        # spatially flipped kernel, input/output channels swapped per group.
        cin = weight.shape[0]
        cout_g = weight.shape[1]
        ks = weight.shape[2:]
        w = weight.reshape((groups, cin // groups, cout_g) + ks)
        w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + ks)
        w = jnp.flip(w, axis=tuple(range(2, 2 + n)))
        pads = []
        for i in range(n):
            edge = dilation[i] * (ks[i] - 1) - padding[i]
            pads.append((edge, edge + output_padding[i]))
        lo_crop = [max(0, -lo) for lo, _ in pads]
        hi_crop = [max(0, -hi) for _, hi in pads]
        out = lax.conv_general_dilated(
            input,
            w,
            window_strides=[1] * n,
            padding=[(max(lo, 0), max(hi, 0)) for lo, hi in pads],
            lhs_dilation=stride,
            rhs_dilation=dilation,
            dimension_numbers=_dims(n),
            feature_group_count=groups,
            precision=_precision(input),
            preferred_element_type=pref,
        )
        if any(lo_crop) or any(hi_crop):
            idx = (slice(None), slice(None)) + tuple(
                slice(lo, out.shape[2 + i] - hi) for i, (lo, hi) in enumerate(zip(lo_crop, hi_crop))
            )
            out = out[idx]
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * n)
    return out.astype(out_dtype) if pref is not None else out


@lower(aten.convolution.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return conv_forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@lower(aten._convolution.default)
def _convolution(
    input,
    weight,
    bias,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    benchmark=False,
    deterministic=False,
    cudnn_enabled=True,
    allow_tf32=True,
):
    return conv_forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@lower(aten.convolution_backward.default)
def convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    def f(x, w):
        return conv_forward(x, w, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(f, input, weight)
    gi, gw = vjp(grad_output.astype(input.dtype))
    gb = None
    if output_mask[2]:
        n = grad_output.ndim
        acc = jnp.float32 if grad_output.dtype in _LOW else grad_output.dtype
        gb = jnp.sum(grad_output.astype(acc), axis=(0,) + tuple(range(2, n))).astype(grad_output.dtype)
    return (gi if output_mask[0] else None, gw if output_mask[1] else None, gb)
