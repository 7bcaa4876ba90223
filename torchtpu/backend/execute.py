"""The executable path of an op: flatten its arguments, run its lowering, wrap the results.

Arguments become (spec, leaves): leaves are the traced values (arrays of tensors, Scalar
arguments), spec is everything static and is part of the executable's cache key. In eager
mode each (op, spec) gets one `jax.jit` executable, which JAX specialises per input
shapes/dtypes/shardings; while tracing (inside a compiled program, or a decomposition being
traced) the lowering is called directly on tracers, so a whole program becomes one XLA
computation. PyTorch's meta kernels give the output dtypes the lowering's results are cast to.
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from . import dtypes
from . import random as tpu_random
from .fused import Deferred, force, record, recordable
from .optable import LOWERINGS
from .plans import OpPlan, argument, decomposition_table, has_composite_implicit
from .state import CONFIG, HOOKS, LOG_RECOMPILES, STATE, STATS, tracing
from .tensor import TpuTensor, internal_index, jax_device, new_base
from .views import array_of, pending_array_of

_T = "\x00T"  # a tpu tensor
_C = "\x00C"  # a CPU tensor (0-dim scalars mixed with device tensors)


class _Dyn:
    """A traced Scalar argument of a given Python type: one instance per type (`_DYN`), so it
    hashes and compares by identity, in C (a spec holding one is hashed on every call)."""

    __slots__ = ("kind",)

    def __init__(self, kind):
        self.kind = kind

    def __repr__(self):
        return f"<{self.kind.__name__}>"


_DYN = {float: _Dyn(float), int: _Dyn(int), bool: _Dyn(bool), complex: _Dyn(complex)}


class _Folded:
    """A traced Scalar argument's value folded into the program (optable.lower's fold). One
    instance per (type, value) (`folded`), so it hashes and compares by identity, and 2 and 2.0,
    which are one dict key, stay two (an integer tensor's `** 2` is an integer, its `** 2.0` a
    float)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"<folded {self.value!r}>"


_FOLDED: dict = {}


def folded(value) -> _Folded:
    key = (type(value), value)
    f = _FOLDED.get(key)
    if f is None:
        f = _FOLDED[key] = _Folded(value)
    return f


_SCALARS: dict = {}


def _scalar_array(value, kind):
    """A weakly-typed device scalar for a Python number, cached: converting a Python scalar
    on every call costs more than the op itself."""
    if STATE.trace_depth:
        return value
    return device_scalar(value, kind)


def device_scalar(value, kind):
    """`_scalar_array` outside tracing: the cached device scalar of `value`, a `kind` number."""
    # 0.0 and -0.0 are one dict key but not one operand (1 / -0.0 is -inf): a float zero, and
    # every complex number (whose parts may be signed zeros), carry their signs in the key
    if kind is float:
        key = (kind, value) if value else (kind, value, math.copysign(1.0, value))
    elif kind is complex:
        key = (kind, value, math.copysign(1.0, value.real), math.copysign(1.0, value.imag))
    else:
        key = (kind, value)
    try:
        return _SCALARS[key]
    except KeyError:
        pass
    if len(_SCALARS) > 4096:
        _SCALARS.clear()
    arr = _SCALARS[key] = jnp.asarray(value)
    return arr


def _flat_value(a, leaves, dyn, read=array_of):
    t = type(a)
    if t is TpuTensor:
        leaves.append(read(a))
        return _T
    if t is list or t is tuple:
        if a and any(isinstance(x, torch.Tensor) for x in a):
            return tuple(_flat_value(x, leaves, False, read) for x in a)
        if dyn and a and all(type(x) in _DYN for x in a):  # a Scalar list traced element by element
            return tuple(_flat_value(x, leaves, True, read) for x in a)
        return tuple(a) if t is list else a
    if isinstance(a, torch.Tensor):
        if isinstance(a, TpuTensor):
            leaves.append(read(a))
            return _T
        leaves.append(dtypes.torch_to_numpy(a) if HOOKS.host is None else HOOKS.host(a))
        return _C
    if dyn and t in _DYN:
        leaves.append(_scalar_array(a, t))
        return _DYN[t]
    if t is torch.SymInt or t is torch.SymFloat:
        raise NotImplementedError("torchtpu eager ops take concrete sizes, not symbolic ones")
    return a


def flatten(plan: OpPlan, args, kwargs, read=None):
    """(spec, kwspec, leaves) of a call; `read` gives a tensor's leaf (default: its array)."""
    leaves = []
    dyn_pos = plan.dyn_pos
    fold = plan.fold
    spec = []
    i = 0
    for a in args:
        if type(a) is TpuTensor:
            if read is None:
                arr = a._st.array
                leaves.append(arr if arr is not None and not a._vw and HOOKS.read is None else array_of(a))
            else:
                leaves.append(read(a))
            spec.append(_T)
        elif fold is not None and i in dyn_pos and i in fold and fold[i](a):
            spec.append(folded(a))
        else:
            spec.append(_flat_value(a, leaves, i in dyn_pos, read or array_of))
        i += 1
    spec = tuple(spec)
    if kwargs:
        dyn_kw = plan.dyn_kw
        fold = fold or {}
        kwspec = tuple(
            (k, folded(v) if k in fold and fold[k](v) else _flat_value(v, leaves, k in dyn_kw, read or array_of))
            for k, v in kwargs.items()
        )
    else:
        kwspec = ()
    return spec, kwspec, leaves


def flatten_pair(plan: OpPlan, args):
    """`flatten(plan, args, {})` for the commonest call, in fewer steps: two arguments, a tpu base
    tensor and another or a Python number the op traces (`a + b`, `a * 2`). Returns
    ((spec, kwspec), leaves), or None where `flatten` itself is needed (other arguments, a view, a
    read hook)."""
    if len(args) != 2:
        return None
    a, b = args
    if type(a) is not TpuTensor:
        return None
    arr = a._st.array
    if arr is None or a._vw or HOOKS.read is not None:
        return None
    t = type(b)
    if t is TpuTensor:
        other = b._st.array
        if other is None or b._vw:
            return None
        return PAIR_OF_TENSORS, (arr, other)
    key = PAIR_WITH_NUMBER.get(t)
    if key is None or 1 not in plan.dyn_pos or plan.fold is not None:
        return None
    return key, (arr, _scalar_array(b, t))


# the (spec, kwspec) keys of those calls, one object each (the direct operators use them too)
PAIR_OF_TENSORS = ((_T, _T), ())
PAIR_WITH_NUMBER = {t: ((_T, kind), ()) for t, kind in _DYN.items()}


def _unflat_value(s, it):
    if s is _T or s is _C:
        return next(it)
    if type(s) is _Dyn:
        return next(it)
    if type(s) is _Folded:
        return s.value
    if type(s) is tuple and s and any(x is _T or x is _C or type(x) is _Dyn for x in s):
        return [_unflat_value(x, it) for x in s]
    return s


def unflatten(spec, kwspec, leaves):
    it = iter(leaves)
    args = [_unflat_value(s, it) for s in spec]
    kwargs = {k: _unflat_value(s, it) for k, s in kwspec}
    return args, kwargs


# ----------------------------------------------------------------------------- meta (expected outputs)


def _meta_value(s, leaf):
    if s is _T or s is _C:
        return torch.empty(tuple(leaf.shape), dtype=dtypes.to_torch_dtype(leaf.dtype), device="meta")
    if type(s) is _Dyn:
        return s.kind(1)
    return s.value if type(s) is _Folded else s


def _meta_args(spec, kwspec, leaves):
    it = iter(leaves)

    def conv(s):
        if s is _T or s is _C or type(s) is _Dyn:
            return _meta_value(s, next(it))
        if type(s) is tuple and s and any(x is _T or x is _C or type(x) is _Dyn for x in s):
            return [conv(x) for x in s]
        return s.value if type(s) is _Folded else s

    args = [conv(s) for s in spec]
    kwargs = {k: conv(s) for k, s in kwspec}
    return args, kwargs


def expected_outputs(func, spec, kwspec, leaves):
    """Run `func` on meta tensors: PyTorch's own answer for output shapes and dtypes."""
    margs, mkwargs = _meta_args(spec, kwspec, leaves)
    try:
        with no_dispatch():
            return func(*margs, **mkwargs)
    except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError) as e:
        if _is_user_error(e):
            raise
        return None
    except Exception:
        return None


def _is_user_error(e) -> bool:
    msg = str(e)
    if "meta" in msg.lower() and ("not implemented" in msg.lower() or "could not run" in msg.lower()):
        return False
    if "data-dependent" in msg or "DynamicOutputShape" in type(e).__name__ or "dynamic" in msg.lower():
        return False
    if isinstance(e, NotImplementedError):
        return False
    return isinstance(e, (RuntimeError, IndexError, ValueError))


def conform(out, expected):
    """Cast lowering outputs to the dtypes PyTorch produces (shape mismatches are bugs)."""
    if expected is None:
        return out
    if isinstance(expected, torch.Tensor):
        if out is None:
            return out
        if isinstance(out, (tuple, list)):  # mutating lowering: (return, new values of mutated args)
            return type(out)([conform(out[0], expected), *out[1:]])
        jdt = dtypes.TORCH_TO_JAX.get(expected.dtype)
        if jdt is not None and out.dtype != jdt:
            out = out.astype(jdt)
        if tuple(out.shape) != tuple(expected.shape):
            raise RuntimeError(
                f"torchtpu internal error: lowering produced shape {tuple(out.shape)}, "
                f"PyTorch expects {tuple(expected.shape)}"
            )
        return out
    if isinstance(expected, (tuple, list)) and isinstance(out, (tuple, list)) and len(out) == len(expected):
        return type(out)(conform(o, e) for o, e in zip(out, expected))
    return out


# ----------------------------------------------------------------------------- running lowerings


def _wrap_tracers(x, device_index):
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return new_base(x, device_index)
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap_tracers(v, device_index) for v in x)
    return x


def _unwrap(x):
    if isinstance(x, TpuTensor):
        return array_of(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, torch.Tensor):
        return jnp.asarray(dtypes.torch_to_numpy(x))
    return x


def _decomposition(func):
    return decomposition_table().get(func)


def implementation(func):
    """A function (args, kwargs) -> JAX outputs, for traced use. None if the op has none."""
    low = LOWERINGS.get(func)
    if low is not None:
        return lambda args, kwargs: low.fn(*args, **kwargs)
    decomp = _decomposition(func)
    if decomp is None:
        decomp = _composite_implicit(func)
    if decomp is None:
        return None

    def via_decomposition(args, kwargs):
        with tracing():
            targs = _wrap_tracers(args, 0)
            tkwargs = {k: _wrap_tracers(v, 0) for k, v in kwargs.items()}
            out = decomp(*targs, **tkwargs)
            return _unwrap(out)

    return via_decomposition


def _composite_implicit(func):
    if has_composite_implicit(func):
        return lambda *a, **k: func.decompose(*a, **k)
    return None


def _trace_body(func, impl, spec, kwspec, random, *leaves, layout=None):
    """What runs inside jax.jit for one op: lowering + PyTorch's dtype rules (and a random op's
    `layout`: see _random_layout)."""
    STATS.misses += 1
    if LOG_RECOMPILES:
        shapes = [tuple(getattr(x, "shape", ())) for x in leaves]
        print(f"[torchtpu] compiling {func} for shapes {shapes}", file=sys.stderr)
    if random:
        key_leaf = leaves[-1]
        leaves = leaves[:-1]
    args, kwargs = unflatten(spec, kwspec, leaves)
    expected = expected_outputs(func, spec, kwspec, leaves)
    if random:
        kwargs["key"] = jax.random.wrap_key_data(key_leaf)
    with tracing():
        out = impl(args, kwargs)
    out = conform(out, expected)
    return out if layout is None else _laid_out(out, leaves[0].shape, layout)


def _random_layout(leaves):
    """The mesh layout of a random op's first argument where it is split over devices, else None.
    The samples shaped like it are then drawn in that layout: each device computes its own block
    (JAX's threefry draws the same numbers however they are split), where XLA would otherwise
    draw the whole tensor on one device and then split it (a sharded parameter's initialisation
    holding the whole parameter on one chip)."""
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    if isinstance(sharding, jax.sharding.NamedSharding) and not sharding.is_fully_replicated:
        return sharding
    return None


def _laid_out(out, shape, layout):
    if isinstance(out, (tuple, list)):
        return type(out)(_laid_out(o, shape, layout) for o in out)
    if isinstance(out, (jax.Array, jax.core.Tracer)) and out.shape == shape:
        return jax.lax.with_sharding_constraint(out, layout)
    return out


def run(plan: OpPlan, func, args, kwargs, pending=False):
    """Compute the functional outputs of `func` as JAX arrays. With `pending` (the dispatcher's
    own calls, which wrap the outputs in tensors), in fused mode: as Deferred values of the op
    recorded for backend.fused."""
    if pending and CONFIG.fused and plan.jit and not STATE.trace_depth:
        return _record(plan, func, args, kwargs)
    spec, kwspec, leaves = flatten(plan, args, kwargs)
    impl = plan.impl
    if impl is None:
        impl = plan.impl = _impl_for(func)
    if plan.random:
        leaves.append(tpu_random.next_key_data(device_index_of(args, kwargs)))
    if STATE.trace_depth or not plan.jit:
        if plan.random:
            kwargs = dict(kwargs)
            args, kwargs = unflatten(spec, kwspec, leaves[:-1])
            kwargs["key"] = jax.random.wrap_key_data(leaves[-1])
        else:
            args, kwargs = unflatten(spec, kwspec, leaves)
        if not plan.jit and not STATE.trace_depth:
            expected = None
        else:
            expected = expected_outputs(func, spec, kwspec, leaves[:-1] if plan.random else leaves)
        return conform(impl(args, kwargs), expected)
    exe = _executable(plan, func, impl, spec, kwspec, _random_layout(leaves) if plan.random else None)
    STATS.calls += 1
    if CONFIG.sync_dispatch:
        return jax.block_until_ready(exe(*leaves))
    return exe(*leaves)


def _executable(plan, func, impl, spec, kwspec, layout=None):
    key = (spec, kwspec) if layout is None else (spec, kwspec, layout)
    exes = plan.executables
    try:
        return exes[key]
    except KeyError:
        try:
            hash(key)
        except TypeError:
            raise NotImplementedError(f"torchtpu: unhashable static argument in {func}: {spec} {kwspec}") from None
        exe = exes[key] = jax.jit(functools.partial(_trace_body, func, impl, spec, kwspec, plan.random, layout=layout))
        return exe


def _record(plan, func, args, kwargs):
    """Fused mode: the op's executable and inputs recorded (backend.fused), its outputs Deferred.
    An op on another device than the process's own first one (tpu:0; under a launcher of one
    device per process, whatever index names it), or with an input that is no array, runs strictly."""
    spec, kwspec, leaves = flatten(plan, args, kwargs, pending_array_of)
    impl = plan.impl
    if impl is None:
        impl = plan.impl = _impl_for(func)
    index = device_index_of(args, kwargs)
    if plan.random:
        leaves.append(tpu_random.next_key_data(index))
    exe = _executable(plan, func, impl, spec, kwspec, _random_layout(leaves) if plan.random else None)
    STATS.calls += 1
    if (index == 0 or _is_first_device(index)) and all(recordable(x) for x in leaves):
        ints = _int_returns(plan, func, exe, spec, kwspec, leaves) if plan.int_returns else ()
        if ints is not None:
            out = record(exe, leaves)
            if ints:
                out = list(out)
                for i, v in zip(plan.int_returns, ints):
                    out[i] = v
                out = tuple(out)
            return out
    return exe(*[force(x) for x in leaves])


@functools.cache
def _is_first_device(index: int) -> bool:
    return jax_device(index) == jax_device(0)


_INT_RETURNS: dict = {}


def _int_returns(plan, func, exe, spec, kwspec, leaves):
    """The values of an op's integer returns (sizes, such as attention's max sequence lengths),
    which a recorded op must give before it runs: PyTorch's meta kernel's, by input shapes.
    None when the meta kernel gives none (the op then runs strictly)."""
    key = (exe, tuple((x.shape, x.dtype) for x in leaves))
    try:
        return _INT_RETURNS[key]
    except KeyError:
        pass
    expected = expected_outputs(func, spec, kwspec, leaves[:-1] if plan.random else leaves)
    ints = None
    if isinstance(expected, (tuple, list)):
        ints = tuple(expected[i] for i in plan.int_returns)
        if not all(type(v) is int for v in ints):
            ints = None
    _INT_RETURNS[key] = ints
    return ints


def _impl_for(func):
    # cached by the caller on plan.impl (one plan per op)
    impl = implementation(func)
    if impl is None:
        raise unsupported(func)
    return impl


class UnsupportedOp(NotImplementedError):
    pass


def unsupported(func):
    """The error for an op with no lowering and no decomposition."""
    return UnsupportedOp(
        f"torchtpu has no lowering for the ATen operator '{func}' (schema: {func._schema}). "
        "Set TORCHTPU_CPU_FALLBACK=1 to run it on the CPU instead, or report it at the torchtpu issue tracker."
    )


def device_index_of(args, kwargs):
    """The tpu device index an op runs on: its first tpu tensor's, or its `device` argument's."""
    for a in args:
        if isinstance(a, TpuTensor):
            return a._st.device_index
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, TpuTensor):
                    return x._st.device_index
    for v in kwargs.values():
        if isinstance(v, TpuTensor):
            return v._st.device_index
        if isinstance(v, torch.device) and v.type == "tpu":
            return 0 if v.index is None else internal_index(v.index)
    return 0


def wrap(out, device_index):
    """Fresh tpu base tensors for the arrays in `out` (a nested list/tuple, or one array)."""
    if out is None:
        return None
    if isinstance(out, (list, tuple)):
        return type(out)(wrap(o, device_index) for o in out)
    if isinstance(out, (jax.Array, jax.core.Tracer)) or type(out) is Deferred:
        return new_base(out, device_index)
    if isinstance(out, np.ndarray):
        return new_base(jnp.asarray(out), device_index)
    return out


def returns(plan, args, kwargs, rets):
    """What a mutating op returns: its aliased arguments, and fresh tensors for `rets`."""
    outs = []
    for k, alias in enumerate(plan.returns_alias):
        if alias is not None:
            outs.append(argument(plan, args, kwargs, alias))
        else:
            outs.append(wrap(rets[k], device_index_of(args, kwargs)))
    if not outs:
        return None
    if len(outs) == 1 and len(plan.func._schema.returns) == 1:
        return outs[0]
    return tuple(outs)
