"""PyTorch's fused optimizer kernels: `_fused_adam_`, `_fused_adamw_`, `_fused_sgd_` and
`_fused_adagrad_` (what `torch.optim.Adam(..., fused=True)` and friends call), with their
functional and out= variants.

One call updates the whole parameter list in one XLA program, with PyTorch's CPU kernels'
arithmetic: each element is updated in the parameters' compute type (float32 for float32,
bfloat16 and float16; float64 for float64) in the kernel's order of operations. The per-step
scalars (bias corrections, step size, Adagrad's decayed lr), which the kernels compute in double
and round, are computed in the compute type too (1 - beta**step as -expm1(step * log(beta))), so
a TPU program holds no float64: they agree with the kernels' to a float32 ulp or two.

AMP: grads are divided by `grad_scale` (and the unscaled grads are written back, as PyTorch's
kernels do), and a `found_inf` equal to 1 leaves every list as it was (the optimizer itself
takes the step count back).

In-place variants have a bespoke handler: it runs the op's lowering, which returns only the
lists the call changes (no copy of unchanged grads), and writes them. A float `lr` is sent to
the program as a device scalar in eager mode (the call runs as the `.tensor_lr` overload), so
a learning rate scheduler never recompiles the update. Functional variants (what torch.compile's
functionalization reaches) return every list.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from ..registry import aten, bind, custom, device_index_of, is_tracing, lower, plan_for, run, wrap, write_value

# ----------------------------------------------------------------------------- shared pieces


def _compute_dtype(dtype):
    """The kernels' opmath type: float64 stays, every other floating type computes in float32."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _one_minus_pow(beta: float, step, dtype):
    """1 - beta**step, accurate for steps where beta**step is close to 1."""
    if beta == 0.0:
        return jnp.ones((), dtype)
    return -jnp.expm1(step.astype(dtype) * jnp.asarray(math.log(beta), dtype))


def _check(op: str, cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(f"torchtpu: aten.{op}: {message}")


def _check_lists(op: str, params, named: dict) -> None:
    for name, values in named.items():
        _check(op, len(values) == len(params), f"`{name}` has {len(values)} tensors, `self` has {len(params)}")
    for i, p in enumerate(params):
        _check(
            op,
            jnp.issubdtype(p.dtype, jnp.floating),
            f"fused optimizers update floating-point parameters; `self[{i}]` is {p.dtype}",
        )


def _lr(lr, dtype):
    return jnp.asarray(lr).reshape(()).astype(dtype)


def _skip(found_inf):
    """True where PyTorch's kernels return without a change: found_inf == 1."""
    if found_inf is None:
        return None
    return found_inf.reshape(()).astype(jnp.float32) == 1.0


def _keep(skip, old, new):
    """`new` cast to `old`'s dtype, or `old` itself where the step is skipped."""
    new = new.astype(old.dtype)
    return new if skip is None else jnp.where(skip, old, new)


def _unscale(grad, grad_scale, compute):
    g = grad.astype(compute)
    if grad_scale is not None:
        g = g / grad_scale.reshape(()).astype(compute)
    return g


# ----------------------------------------------------------------------------- the updates
# Each returns {argument name: new list, or None where the call leaves that list unchanged}.


def _adam(
    op,
    adamw,
    self,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    amsgrad,
    maximize,
    grad_scale,
    found_inf,
):
    lists = dict(grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, state_steps=state_steps)
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    _check_lists(op, self, lists)
    if not amsgrad:
        _check(op, not max_exp_avg_sqs, "`max_exp_avg_sqs` must be empty when amsgrad is False")
    skip = _skip(found_inf)
    out = dict(self=[], grads=[] if grad_scale is not None else None, exp_avgs=[], exp_avg_sqs=[])
    out["max_exp_avg_sqs"] = [] if amsgrad else None
    for i, param in enumerate(self):
        ct = _compute_dtype(param.dtype)
        c = lambda x, ct=ct: np.asarray(x, ct)  # noqa: E731  a double rounded as the kernels' scalar_t(x)
        step = state_steps[i]
        lr_w = _lr(lr, ct)
        bias_correction2_sqrt = jnp.sqrt(_one_minus_pow(beta2, step, ct))
        step_size = lr_w / _one_minus_pow(beta1, step, ct)

        p = param.astype(ct)
        g = _unscale(grads[i], grad_scale, ct)
        if grad_scale is not None:
            out["grads"].append(_keep(skip, grads[i], g))
        if maximize:
            g = -g
        if weight_decay != 0.0:
            if adamw:
                p = p * (1 - lr_w * c(weight_decay))
            else:
                g = g + p * c(weight_decay)
        # exp_avg.lerp_(grad, 1 - beta1), in the form lerp picks for the weight's size
        m = exp_avgs[i].astype(ct)
        w = c(1 - beta1)
        if abs(w) < 0.5:
            m = m + w * (g - m)
        else:
            m = g - (g - m) * (c(1) - w)
        v = exp_avg_sqs[i].astype(ct) * c(beta2) + c(1 - beta2) * g * g
        second = v
        if amsgrad:
            second = jnp.maximum(max_exp_avg_sqs[i].astype(ct), v)
            out["max_exp_avg_sqs"].append(_keep(skip, max_exp_avg_sqs[i], second))
        denom = jnp.sqrt(second) / bias_correction2_sqrt + c(eps)
        p = p - step_size * m / denom
        out["self"].append(_keep(skip, param, p))
        out["exp_avgs"].append(_keep(skip, exp_avgs[i], m))
        out["exp_avg_sqs"].append(_keep(skip, exp_avg_sqs[i], v))
    return out


def _sgd(
    op,
    self,
    grads,
    momentum_buffer_list,
    weight_decay,
    momentum,
    lr,
    dampening,
    nesterov,
    maximize,
    is_first_step,
    grad_scale,
    found_inf,
):
    lists = dict(grads=grads)
    if momentum != 0.0:
        lists["momentum_buffer_list"] = momentum_buffer_list
    else:
        _check(op, not momentum_buffer_list, "`momentum_buffer_list` must be empty when momentum is 0")
    _check_lists(op, self, lists)
    skip = _skip(found_inf)
    out = dict(self=[], grads=[] if grad_scale is not None else None)
    out["momentum_buffer_list"] = [] if momentum != 0.0 else None
    for i, param in enumerate(self):
        ct = _compute_dtype(param.dtype)
        c = lambda x, ct=ct: np.asarray(x, ct)  # noqa: E731
        p = param.astype(ct)
        g = _unscale(grads[i], grad_scale, ct)
        if grad_scale is not None:
            out["grads"].append(_keep(skip, grads[i], g))
        if maximize:
            g = -g
        if weight_decay != 0.0:
            g = g + p * c(weight_decay)
        if momentum != 0.0:
            if is_first_step:
                buf = g
            else:
                buf = momentum_buffer_list[i].astype(ct) * c(momentum) + g * c(1 - dampening)
            out["momentum_buffer_list"].append(_keep(skip, momentum_buffer_list[i], buf))
            g = g + buf * c(momentum) if nesterov else buf
        p = p - g * _lr(lr, ct)
        out["self"].append(_keep(skip, param, p))
    return out


def _adagrad(
    op, self, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale, found_inf
):
    _check_lists(op, self, dict(grads=grads, state_sums=state_sums, state_steps=state_steps))
    skip = _skip(found_inf)
    out = dict(self=[], grads=[] if grad_scale is not None else None, state_sums=[], state_steps=None)
    for i, param in enumerate(self):
        ct = _compute_dtype(param.dtype)
        c = lambda x, ct=ct: np.asarray(x, ct)  # noqa: E731
        step = state_steps[i].astype(ct)
        clr = _lr(lr, ct) / (1 + (step - 1) * c(lr_decay))
        p = param.astype(ct)
        g = _unscale(grads[i], grad_scale, ct)
        if grad_scale is not None:
            out["grads"].append(_keep(skip, grads[i], g))
        if maximize:
            g = -g
        if weight_decay != 0.0:
            g = g + p * c(weight_decay)
        total = state_sums[i].astype(ct) + g * g
        p = p - clr * g / (jnp.sqrt(total) + c(eps))
        out["self"].append(_keep(skip, param, p))
        out["state_sums"].append(_keep(skip, state_sums[i], total))
    return out


# ----------------------------------------------------------------------------- registration

_UPDATES = {
    "_fused_adam": lambda *a: _adam("_fused_adam", False, *a),
    "_fused_adamw": lambda *a: _adam("_fused_adamw", True, *a),
    "_fused_sgd": lambda *a: _sgd("_fused_sgd", *a),
    "_fused_adagrad": lambda *a: _adagrad("_fused_adagrad", *a),
}


def _arguments(func, args, kwargs) -> dict:
    """The call's arguments by schema name, in schema order, without out=."""
    bound = bind(func, args, kwargs)
    bound.pop("out", None)
    return bound


def _functional_lowering(family, func):
    """Every list the schema returns, the unchanged ones as they came in."""
    returned = [r.name.removesuffix("_out") for r in func._schema.returns]

    def lowering(*args, **kwargs):
        given = _arguments(func, args, kwargs)
        new = _UPDATES[family](*given.values())
        return tuple(given[name] if new.get(name) is None else new[name] for name in returned)

    return lowering


def _written(func) -> list:
    return [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _inplace_lowering(family, func):
    """The new values of the mutated lists in schema order; None for a list left unchanged."""
    written = _written(func)

    def lowering(*args, **kwargs):
        new = _UPDATES[family](*_arguments(func, args, kwargs).values())
        return tuple(new.get(name) for name in written)

    return lowering


def _inplace_handler(func, tensor_lr):
    written = _written(func)

    def handle(args, kwargs):
        op = func
        if tensor_lr is not None and not is_tracing():
            # in eager mode a float lr is a program input: a scheduler's new value every step
            # reuses the program (inside a traced step it is a constant of the trace)
            op = tensor_lr
            dtype = jnp.float64 if any(p.dtype == torch.float64 for p in args[0]) else jnp.float32
            kwargs = dict(kwargs, lr=wrap(jnp.asarray(float(kwargs["lr"]), dtype), device_index_of(args, kwargs)))
        new = run(plan_for(op), op, args, kwargs)
        given = _arguments(func, args, kwargs)
        for name, lists in zip(written, new):
            if lists is not None:
                for t, value in zip(given[name], lists):
                    write_value(t, value)

    return handle


def _out_handler(out_op, functional):
    """`.out`: the functional's new parameters go to `out`. Like PyTorch's own out= kernel, it
    changes nothing else (the other lists keep their values, whatever the schema marks)."""

    def handle(args, kwargs):
        given = _arguments(out_op, args, kwargs)
        positional = [given[a.name] for a in functional._schema.arguments if not a.kwarg_only]
        keywords = {a.name: given[a.name] for a in functional._schema.arguments if a.kwarg_only}
        new = run(plan_for(functional), functional, positional, keywords)
        for t, value in zip(kwargs["out"], new[0]):
            write_value(t, value, resize=True)

    return handle


def _register() -> None:
    for family in _UPDATES:
        functional = getattr(aten, family)
        inplace = getattr(aten, family + "_")
        for overload in ("default", "tensor_lr"):
            lower(getattr(functional, overload))(_functional_lowering(family, getattr(functional, overload)))
            op = getattr(inplace, overload)
            lower(op)(_inplace_lowering(family, op))
            custom(op)(_inplace_handler(op, inplace.tensor_lr if overload == "default" else None))
        for overload, base in (("out", "default"), ("tensor_lr_out", "tensor_lr")):
            custom(getattr(functional, overload))(
                _out_handler(getattr(functional, overload), getattr(functional, base))
            )


_register()
