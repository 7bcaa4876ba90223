"""`torch.nn.attention.flex_attention` on tpu tensors, without Inductor.

PyTorch runs FlexAttention as two higher-order operators, `flex_attention` and
`flex_attention_backward` (torch/_higher_order_ops/flex_attention.py). Their autograd rule
(`FlexAttentionAutogradOp`) is device-independent (for real tpu tensors it runs without the joint
graph of score_mod PyTorch would trace on every call: `_tpu_autograd`); below it each operator
dispatches on the Python key to a kernel registered for the tensor's Python type. This module
registers those kernels for `TpuTensor` (`py_impl(TpuTensor)`), so every route into
FlexAttention on tpu lands here:

- eager `flex_attention(q, k, v, ...)`: PyTorch wraps the operator in
  `torch.compile(backend="eager")`, so Dynamo turns `score_mod` and `mask_mod` into FX graphs
  and lifts the tensors they capture into `*_other_buffers`; the graph then calls the operator
  on the tpu tensors;
- `torch.compile(..., backend="tpu")` (and the default Inductor backend, which
  torchtpu.backend.dynamo hands tpu graphs to): AOTAutograd puts the two operators into the
  forward and backward graphs, which run on traced tpu tensors;
- `torchtpu.compile` steps: the eager route, on tensors that wrap JAX tracers.

A kernel turns `score_mod` and `mask_mod` into JAX functions of 0-d arrays (each argument wrapped
as a tpu tensor, the function's torch ops lowered through the op table) and runs the math of
ops/flex_attention.py on the arrays. In eager mode the whole forward, or backward, is one
`jax.jit` program, cached per (score_mod, mask_mod) when they are FX graphs (pure functions of
their arguments, as Dynamo makes them); plain Python functions, which may read tensors they
capture, run op by op instead. Inside a traced program the math is traced in place.

The operators return the log-sum-exp and the row maximum in base 2, which PyTorch's wrapper
converts back; the backward operator gets them, and the lse's gradient, in the same base.

`flex_attention` itself refuses devices it does not know in `_validate_device`; `install`
swaps in a check that lets tpu through (torchtpu/_flex_device.py) and registers autocast for
the operator under `torch.autocast("tpu")`.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import torch
from torch._C import DispatchKey

from . import dtypes
from .ops import flex_attention as flex_ops
from .state import CONFIG, is_tracing, tracing
from .tensor import NOT_DENSE, TpuTensor, memory_order, new_base, storage_of
from .views import array_of

_LN2 = math.log(2.0)
_CACHE_SIZE = 64
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()  # eager jax.jit programs


# ----------------------------------------------------------------------------- mods as JAX functions


def _array(x):
    if isinstance(x, TpuTensor):
        return array_of(x)
    if isinstance(x, torch.Tensor):
        return jnp.asarray(dtypes.torch_to_numpy(x.detach()))
    return jnp.asarray(x)


def _jax_mod(fn, device_index: int, buffers: tuple):
    """`fn(*leading, *buffers)` as a function of arrays: the leading tensors (score?, b, h, q_idx,
    kv_idx) and then the array of each tensor buffer (its other buffers stay Python values)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    slots = [i for i, b in enumerate(buffers) if isinstance(b, torch.Tensor)]

    def run(*arrays):
        n_leading = len(arrays) - len(slots)
        args = list(buffers)
        for i, a in zip(slots, arrays[n_leading:]):
            args[i] = a
        with tracing(), torch.no_grad(), TransformGetItemToIndex():
            wrapped = [new_base(a, device_index) for a in arrays[:n_leading]]
            wrapped += [new_base(args[i], device_index) if i in slots else args[i] for i in range(len(args))]
            out = fn(*wrapped)
        return _array(out)

    return run


def _is_noop(fn, names) -> bool:
    return fn is None or getattr(fn, "__module__", None) == "torch.nn.attention.flex_attention" and fn.__name__ in names


def _cacheable(*fns) -> bool:
    return all(fn is None or isinstance(fn, torch.fx.GraphModule) for fn in fns)


def _tensor_arrays(buffers):
    return tuple(_array(b) for b in buffers if isinstance(b, torch.Tensor))


def _blocks(block_mask, arrays):
    kv_num, kv_idx, full_num, full_idx = arrays
    return flex_ops.Blocks(kv_num, kv_idx, full_num, full_idx, int(block_mask[14]), int(block_mask[15]))


def _block_arrays(block_mask):
    return tuple(None if t is None else _array(t) for t in block_mask[2:6])


# ----------------------------------------------------------------------------- layouts


def _strides_like(shape, ref_strides):
    """Dense strides for `shape` with the dims in the memory order of `ref_strides` (PyTorch's
    FlexAttention gives the output the query's layout and each gradient its input's)."""
    order = sorted(range(len(shape)), key=lambda i: ref_strides[i], reverse=True)
    strides, acc = [0] * len(shape), 1
    for i in reversed(order):
        strides[i] = acc
        acc *= max(shape[i], 1)
    return tuple(strides)


def _wrap_like(array, device_index, ref):
    t = new_base(array, device_index)
    if ref is None or t.dim() != ref.dim():
        return t
    strides = _strides_like(tuple(t.shape), ref.stride())
    if strides == t.stride():
        return t
    order = memory_order(tuple(t.shape), strides)
    if order is not None and order is not NOT_DENSE:
        storage_of(t).order = order
    return TpuTensor(storage_of(t), (), tuple(t.shape), t.dtype, strides=strides)


# ----------------------------------------------------------------------------- running


def _run(key, build, arrays, cacheable):
    """`build()(*arrays)`: traced in place inside a program, else one cached jax.jit program
    (when the mods are pure), else op by op."""
    if is_tracing():
        return build()(*arrays)
    if not cacheable:
        return build()(*arrays)
    program = _PROGRAMS.get(key)
    if program is None:
        program = _PROGRAMS[key] = jax.jit(build())
        if len(_PROGRAMS) > _CACHE_SIZE:
            _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(key)
    out = program(*arrays)
    return jax.block_until_ready(out) if CONFIG.sync_dispatch else out


def _device_index(t) -> int:
    return storage_of(t).device_index


def _mods(score_mod, mask_mod, device_index, score_bufs, mask_bufs):
    score_fn = None if _is_noop(score_mod, ("_identity",)) else _jax_mod(score_mod, device_index, score_bufs)
    mask_fn = None if _is_noop(mask_mod, ("noop_mask",)) else _jax_mod(mask_mod, device_index, mask_bufs)
    return score_fn, mask_fn


def _forward(query, key, value, score_mod, block_mask, scale, kernel_options, score_bufs=(), mask_bufs=()):
    dev = _device_index(query)
    mask_mod = block_mask[-1]
    score_bufs, mask_bufs = tuple(score_bufs), tuple(mask_bufs)

    def build():
        score_fn, mask_fn = _mods(score_mod, mask_mod, dev, score_bufs, mask_bufs)

        def program(q, k, v, blocks, s_arrays, m_arrays):
            out, lse, top = flex_ops.forward(
                q, k, v, _blocks(block_mask, blocks), score_fn, mask_fn, s_arrays, m_arrays, scale=scale
            )
            return out, lse / _LN2, top / _LN2

        return program

    arrays = (
        array_of(query),
        array_of(key),
        array_of(value),
        _block_arrays(block_mask),
        _tensor_arrays(score_bufs),
        _tensor_arrays(mask_bufs),
    )
    cache_key = _program_key("forward", score_mod, mask_mod, scale, block_mask, dev, score_bufs, mask_bufs)
    out, lse, top = _run(cache_key, build, arrays, _cacheable(score_mod, mask_mod))
    return _wrap_like(out, dev, query), new_base(lse, dev), new_base(top, dev)


def _statics(buffers):
    """The Python values among a mod's buffers (they are baked into its program)."""
    return tuple(("T",) if isinstance(b, torch.Tensor) else ("V", b) for b in buffers)


def _program_key(kind, score_mod, mask_mod, scale, block_mask, dev, score_bufs, mask_bufs):
    """What an eager program depends on beyond its arrays' shapes and dtypes."""
    sizes = (int(block_mask[14]), int(block_mask[15]), flex_ops.Q_BLOCK)
    return (kind, score_mod, mask_mod, float(scale), sizes, dev) + _statics(score_bufs) + _statics(mask_bufs)


def _backward(
    query,
    key,
    value,
    out,
    logsumexp,
    grad_out,
    grad_logsumexp,
    fw_graph,
    joint_graph,
    block_mask,
    scale,
    kernel_options,
    score_bufs=(),
    mask_bufs=(),
):
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise ValueError(
            "flex_attention backward with mixed query, key and value dtypes is not supported, got "
            f"query {query.dtype}, key {key.dtype}, value {value.dtype}"
        )
    dev = _device_index(query)
    mask_mod = block_mask[-1]
    score_bufs, mask_bufs = tuple(score_bufs), tuple(mask_bufs)

    def build():
        score_fn, mask_fn = _mods(fw_graph, mask_mod, dev, score_bufs, mask_bufs)

        def program(q, k, v, o, lse2, g, glse2, blocks, s_arrays, m_arrays):
            # the operators' statistics are in base 2: lse = lse2 * ln 2, d/d lse = d/d lse2 / ln 2
            glse = None if glse2 is None else glse2 / _LN2
            return flex_ops.backward(
                q,
                k,
                v,
                o,
                lse2 * _LN2,
                g,
                glse,
                _blocks(block_mask, blocks),
                score_fn,
                mask_fn,
                s_arrays,
                m_arrays,
                scale=scale,
            )

        return program

    arrays = (
        array_of(query),
        array_of(key),
        array_of(value),
        array_of(out),
        array_of(logsumexp),
        None if grad_out is None else array_of(grad_out),
        None if grad_logsumexp is None else array_of(grad_logsumexp),
        _block_arrays(block_mask),
        _tensor_arrays(score_bufs),
        _tensor_arrays(mask_bufs),
    )
    cache_key = _program_key("backward", fw_graph, mask_mod, scale, block_mask, dev, score_bufs, mask_bufs)
    cache_key += (grad_out is None, grad_logsumexp is None)
    dq, dk, dv, dbufs = _run(cache_key, build, arrays, _cacheable(fw_graph, mask_mod))
    it = iter(dbufs)
    grads = []
    for b in score_bufs:
        if isinstance(b, torch.Tensor):
            d = next(it)
            grads.append(None if d is None else new_base(d, dev))
        else:
            grads.append(None)
    return (
        _wrap_like(dq, dev, query),
        _wrap_like(dk, dev, key),
        _wrap_like(dv, dev, value),
        tuple(grads),
    )


def _tpu_autograd(original):
    """The operator's autograd kernel: PyTorch's (`flex_attention_autograd`) for every tensor but
    a real tpu tensor, for which it runs `FlexAttentionAutogradOp` without a joint graph of
    score_mod. PyTorch traces that graph with make_fx on every call (its CUDA and CPU kernels read
    it), feeding it fake tensors beside a real example gradient; for a tensor subclass such as
    TpuTensor that mix fails inside the autograd engine, and the tpu backward kernel
    differentiates score_mod with jax.vjp instead, so the graph is not needed."""

    def autograd(query, key, value, score_mod, block_mask, scale, kernel_options, score_bufs=(), mask_bufs=()):
        if type(query) is not TpuTensor:
            return original(query, key, value, score_mod, block_mask, scale, kernel_options, score_bufs, mask_bufs)
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
        from torch._higher_order_ops.flex_attention import FlexAttentionAutogradOp

        tensors = (query, key, value, *score_bufs)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            if block_mask[7] is None:
                raise RuntimeError(
                    "BlockMask q_indices is None. Backward pass requires q_indices to be computed. "
                    "Please create the BlockMask with compute_q_blocks=True"
                )
        with TransformGetItemToIndex():
            return FlexAttentionAutogradOp.apply(
                query, key, value, score_mod, None, block_mask, scale, kernel_options, mask_bufs, *score_bufs
            )

    autograd.__wrapped__ = original
    return autograd


def _autocast(query, key, value, score_mod, block_mask, scale, kernel_options, score_bufs=(), mask_bufs=()):
    """Under torch.autocast("tpu"): q, k, v in the autocast dtype, as PyTorch's CPU and CUDA
    autocast rules for the operator do."""
    from torch._higher_order_ops.flex_attention import flex_attention

    dtype = torch.get_autocast_dtype("tpu")

    def cast(t):
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(DispatchKey.AutocastPrivateUse1)):
        return flex_attention(
            cast(query), cast(key), cast(value), score_mod, block_mask, scale, kernel_options, score_bufs, mask_bufs
        )


def _autocast_backward(*args, **kwargs):
    """The backward under torch.autocast("tpu") (AOTAutograd traces a compiled forward's backward
    with the forward's autocast state on): it runs in the dtypes the forward saved, as it does without
    autocast."""
    from torch._higher_order_ops.flex_attention import flex_attention_backward

    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(DispatchKey.AutocastPrivateUse1)):
        return flex_attention_backward(*args, **kwargs)


def _pass_through(hop):
    """A kernel for AOTAutograd's aliasing check (`_AnalyzeCustomOpInputOutputMode`), which runs
    around the first call of a compiled graph: it leaves higher-order operators unchecked, but
    for a tensor type it does not know (TpuTensor) it answers NotImplemented, and the operator's
    dispatch would stop there. With the mode popped, the operator runs as it would without it."""

    def run(mode, *args, **kwargs):
        return hop(*args, **kwargs)

    return run


# ----------------------------------------------------------------------------- installation

_installed = False


def install() -> None:
    """Register the tpu kernels of the two operators and let flex_attention accept tpu tensors."""
    global _installed
    if _installed:
        return
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward
    from torch.nn.attention import flex_attention as api

    from .._flex_device import accepting_tpu

    flex_attention.py_impl(TpuTensor)(_forward)
    flex_attention_backward.py_impl(TpuTensor)(_backward)
    flex_attention.py_impl(DispatchKey.AutocastPrivateUse1)(_autocast)
    flex_attention_backward.py_impl(DispatchKey.AutocastPrivateUse1)(_autocast_backward)
    # py_impl refuses a second kernel for a key, so the autograd kernel is wrapped in place
    flex_attention.py_kernels[DispatchKey.Autograd] = _tpu_autograd(flex_attention.py_kernels[DispatchKey.Autograd])
    flex_attention._dispatch_cache.clear()
    api._validate_device = accepting_tpu(api._validate_device)
    _installed = True


def install_compiled() -> None:
    """The part of `install` for compiled graphs, run once torch._dynamo is imported (by
    torchtpu.backend.dynamo.register): AOTAutograd's aliasing check lets the operators through."""
    from torch._functorch._aot_autograd.runtime_wrappers import _AnalyzeCustomOpInputOutputMode as aliasing_check
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    for hop in (flex_attention, flex_attention_backward):
        if aliasing_check not in hop.python_key_table:
            hop.py_impl(aliasing_check)(_pass_through(hop))
