"""From an ATen call on tpu tensors to JAX.

Every op reaching `TpuTensor.__torch_dispatch__` is classified once from its schema:

- view ops return a tensor sharing the input's storage, with one more view step;
- in-place-view ops (transpose_, squeeze_...) change a tensor's metadata and view chain;
- mutating ops (add_, add.out, _foreach_mul_, copy_...) compute the new values of the
  mutated arguments functionally, then write them back through the storage;
- functional ops compute fresh outputs.

Computation goes through `run`: in eager mode one `jax.jit` executable per
(op, non-tensor arguments), which JAX specialises per input shapes/dtypes/shardings; while
tracing (inside a compiled program, or a decomposition being traced) the lowering is called
directly on tracers, so a whole program becomes one XLA computation.
"""
from __future__ import annotations

import functools
import linecache
import os
import sys
import threading
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from . import dtypes
from .registry import LOWERINGS, Lowering
from .tensor import NOT_DENSE, Storage, TpuTensor, contiguous_strides, new_base, place, storage_order, torch_device

aten = torch.ops.aten

# ----------------------------------------------------------------------------- state


class _State(threading.local):
    def __init__(self):
        self.trace_depth = 0


STATE = _State()
from jax._src.array import ArrayImpl as _ArrayImpl  # noqa: E402  (the concrete jax.Array type)


class CacheStats:
    """Eager executable cache counters. A miss is a trace + compile of a new signature."""

    def __init__(self):
        self.hits = 0
        self.misses = 0
        self.calls = 0

    def snapshot(self) -> dict:
        return {"hits": self.calls - self.misses, "misses": self.misses, "calls": self.calls}

    def reset(self):
        self.hits = self.misses = self.calls = 0


STATS = CacheStats()
_LOG_RECOMPILES = bool(os.environ.get("TORCHTPU_LOG_RECOMPILES"))


class _Config:
    debug = bool(os.environ.get("TORCHTPU_DEBUG"))
    cpu_fallback = bool(os.environ.get("TORCHTPU_CPU_FALLBACK"))
    # XLA:CPU runs the collectives of programs over several host devices with a rendezvous
    # that can deadlock when many such programs are in flight at once (async dispatch). Once
    # a device mesh exists on the CPU platform, eager ops therefore wait for their results.
    sync_dispatch = False
    mesh_active = False  # a device mesh exists: in-place writes keep mesh layouts


CONFIG = _Config()


def tracing() -> bool:
    return STATE.trace_depth > 0


class _Tracing:
    def __enter__(self):
        STATE.trace_depth += 1

    def __exit__(self, *exc):
        STATE.trace_depth -= 1


# ----------------------------------------------------------------------------- arrays of tensors


def _zeros_fn(shape, dtype):
    return jnp.zeros(shape, dtype)


_ZEROS = jax.jit(_zeros_fn, static_argnums=(0, 1))


class _Hooks:
    """Observers of storage reads, used by torchtpu.compile (None when unused, which keeps
    the eager hot path free of them)."""

    read = None  # callable(storage, array) -> array, or None
    host = None  # callable(cpu tensor) -> array: a CPU tensor read by a tpu op, or None


HOOKS = _Hooks()


def storage_array(st: Storage):
    a = st.array
    if HOOKS.read is not None:
        a = HOOKS.read(st, a)
    if a is None:
        jdt = dtypes.to_jax_dtype(st.dtype)
        if tracing():
            a = jnp.zeros(st.shape, jdt)
        elif st.dist is not None and len(st.dist) > 2:
            a = jnp.zeros(st.shape, jdt, device=st.dist[2])  # made in place, never whole on one device
            st.array = a
        else:
            with jax.default_device(jax.devices()[st.device_index]):
                a = _ZEROS(st.shape, jdt)
            st.array = a
    return a


def array_of(t: TpuTensor):
    """The JAX array holding `t`'s current values."""
    st = t._st
    vw = t._vw
    if not vw:
        a = st.array
        return a if a is not None and HOOKS.read is None else storage_array(st)
    if t._vv == st.version and t._vc is not None and HOOKS.read is None:
        return t._vc
    base = storage_array(st)
    a = run_chain(vw, base)
    if not tracing():
        t._vc = a
        t._vv = st.version
    return a


def write(t: TpuTensor, new) -> None:
    """Make `new` (shaped and typed like `t`) the value of `t`, through any view."""
    st = t._st
    if not t._vw:
        if st.dist is not None or CONFIG.mesh_active:
            new = _keep_dist_layout(st, new)
        st.array = new
    else:
        st.array = scatter_chain(t._vw, storage_array(st), new)
    st.version += 1


def note_mesh(jax_mesh) -> None:
    """Arrays laid out over `jax_mesh` exist from now on (see _Config)."""
    if jax_mesh.size > 1:
        CONFIG.mesh_active = True
        if jax_mesh.devices.flat[0].platform == "cpu":
            CONFIG.sync_dispatch = True


def _keep_dist_layout(st, new):
    # A write into a tensor laid out over a mesh keeps its layout (as DTensor's in-place ops
    # do): parameters initialised in place stay sharded.
    old = st.array
    if type(new) is _ArrayImpl:
        if type(old) is _ArrayImpl:
            sharding = old.sharding
            if not isinstance(sharding, jax.sharding.NamedSharding):
                return new
        elif st.dist is not None:
            sharding = st.dist[2]
        else:
            return new
        if new.sharding != sharding:
            new = jax.device_put(new, sharding)
    return new


# ----------------------------------------------------------------------------- view chains
# A view step is (op, static args, output index). Reading applies each op's lowering.


def _apply_step(step, a):
    func, statics, index = step[0], step[1], step[2]
    out = LOWERINGS[func].fn(a, *statics)
    return out if index is None else out[index]


def _chain_fn(chain, base):
    a = base
    for step in chain:
        # as_strided addresses the storage itself, whatever views came before it; a 4th
        # entry puts a base with non-row-major strides in memory order first
        if step[0] in _STORAGE_RELATIVE:
            a = _apply_step(step, base if len(step) == 3 else jnp.transpose(base, step[3]))
        else:
            a = _apply_step(step, a)
    return a


_STORAGE_RELATIVE = {aten.as_strided.default}


@functools.lru_cache(maxsize=None)
def _jitted_chain(chain):
    return jax.jit(functools.partial(_chain_fn, chain))


def run_chain(chain, base):
    if tracing():
        return _chain_fn(chain, base)
    out = _jitted_chain(chain)(base)
    return jax.block_until_ready(out) if CONFIG.sync_dispatch else out


def _scatter_fn(chain, base, new):
    index = jnp.arange(base.size, dtype=jnp.int64).reshape(base.shape)
    target = _chain_fn(chain, index)
    new = jnp.broadcast_to(new.astype(base.dtype), target.shape)
    flat = base.reshape(-1).at[target.reshape(-1)].set(new.reshape(-1))
    return flat.reshape(base.shape)


@functools.lru_cache(maxsize=None)
def _jitted_scatter(chain):
    return jax.jit(functools.partial(_scatter_fn, chain), donate_argnums=())


def scatter_chain(chain, base, new):
    if tracing():
        return _scatter_fn(chain, base, new)
    out = _jitted_scatter(chain)(base, new)
    return jax.block_until_ready(out) if CONFIG.sync_dispatch else out


# ----------------------------------------------------------------------------- op plans


# Python numbers in these positions are traced: Scalar arguments, and Tensor arguments that
# PyTorch lets callers pass a Python number for (`x * 0.1` reaches mul.Tensor with a float).
_SCALAR_TYPES = ("number", "Optional[number]", "Tensor", "Optional[Tensor]")


# Ops that make a tensor "like" their input: the result keeps the input's mesh layout (so
# optimizer moments made with zeros_like(param) are sharded like the parameter).
_LIKE_OPS = frozenset([f"aten::{n}_like" for n in ("zeros", "ones", "full", "empty", "rand", "randn", "randint")]
                       + ["aten::clone"])


# func -> fn(args, out) -> out: fix-ups of an op's wrapped outputs (e.g. strides PyTorch's meta
# function promises that differ from the contiguous layout of a fresh result)
POST: dict = {}


class OpPlan:
    __slots__ = (
        "func", "kind", "arg_names", "dyn_pos", "dyn_kw", "impl", "mutated", "returns_alias",
        "functional", "lowering", "random", "jit", "name", "executables", "like", "int_returns", "post",
    )


_PLANS: dict = {}
_CUSTOM: dict = {}  # func -> handler(args, kwargs) for ops with bespoke semantics


def custom(*ops):
    def register(fn):
        for op in ops:
            _CUSTOM[op] = fn
        return fn

    return register


def _functional_variant(func):
    """aten.add_.Tensor -> aten.add.Tensor; aten.add.out -> aten.add.Tensor; None if none."""
    schema = func._schema
    name = schema.name.split("::")[1]
    packet_name = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    packet = getattr(aten, packet_name, None)
    if packet is None:
        return None
    # the functional twin takes the same arguments minus the out= tensors
    want = [(a.name, str(a.type)) for a in schema.arguments
            if not (a.alias_info and a.alias_info.is_write and a.kwarg_only)]
    candidates = [getattr(packet, o) for o in packet.overloads()]
    candidates = [c for c in candidates if c is not func and not c._schema.is_mutable]
    for cand in candidates:
        if [(a.name, str(a.type)) for a in cand._schema.arguments] == want:
            return cand
    # loose match on names only (types may differ, as Tensor vs Tensor?)
    for cand in candidates:
        if [a.name for a in cand._schema.arguments] == [n for n, _ in want]:
            return cand
    return None


def _plan(func) -> OpPlan:
    p = OpPlan()
    p.func = func
    p.impl = None
    p.executables = {}
    p.name = str(func)
    schema = func._schema
    p.like = schema.name in _LIKE_OPS
    p.post = POST.get(func)
    p.int_returns = tuple(i for i, r in enumerate(schema.returns) if str(r.type) in ("SymInt", "int"))
    p.arg_names = [a.name for a in schema.arguments]
    p.lowering = LOWERINGS.get(func)
    static = p.lowering.static if p.lowering else frozenset()
    p.dyn_pos = frozenset(
        i for i, a in enumerate(schema.arguments)
        if str(a.type) in _SCALAR_TYPES and not a.kwarg_only and a.name not in static
    )
    p.dyn_kw = frozenset(
        a.name for a in schema.arguments if str(a.type) in _SCALAR_TYPES and a.kwarg_only and a.name not in static
    )
    p.random = bool(p.lowering and p.lowering.random)
    p.jit = not (p.lowering and not p.lowering.jit)
    p.mutated = [i for i, a in enumerate(schema.arguments) if a.alias_info and a.alias_info.is_write]
    p.functional = None
    rets = schema.returns
    p.returns_alias = []
    for r in rets:
        idx = None
        if r.alias_info is not None:
            for i, a in enumerate(schema.arguments):
                if a.alias_info and set(a.alias_info.before_set) & set(r.alias_info.before_set):
                    idx = i
                    break
        p.returns_alias.append(idx)
    if func in _CUSTOM:
        p.kind = "custom"
    elif p.lowering is None and func not in _decomposition_table() and _has_composite_implicit(func):
        # CompositeImplicitAutograd ops reach the Python key when autograd is excluded
        # (inside other ops' dispatch): run their decomposition at the ATen level.
        p.kind = "composite"
    elif torch._C.Tag.inplace_view in func.tags:
        p.kind = "inplace_view"
    elif p.mutated:
        p.kind = "mutating"
        if p.lowering is None:
            p.functional = _functional_variant(func)
            if p.functional is not None:
                fp = _PLANS.get(p.functional) or _plan(p.functional)
                _PLANS[p.functional] = fp
                p.random = fp.random
                p.jit = fp.jit
    elif any(r.alias_info is not None and not r.alias_info.is_write for r in rets):
        p.kind = "view"
    else:
        p.kind = "functional"
    return p


def plan_for(func) -> OpPlan:
    p = _PLANS.get(func)
    if p is None:
        p = _PLANS[func] = _plan(func)
    return p


# ----------------------------------------------------------------------------- flattening
# Arguments become (spec, leaves): leaves are the traced values (arrays of tensors, Scalar
# arguments), spec is everything static and is part of the executable's cache key.

_T = "\x00T"  # a tpu tensor
_C = "\x00C"  # a CPU tensor (0-dim scalars mixed with device tensors)


class _Dyn:
    """A traced Scalar argument of a given Python type."""

    __slots__ = ("kind",)

    def __init__(self, kind):
        self.kind = kind

    def __hash__(self):
        return hash(self.kind)

    def __eq__(self, other):
        return type(other) is _Dyn and other.kind is self.kind

    def __repr__(self):
        return f"<{self.kind.__name__}>"


_DYN = {float: _Dyn(float), int: _Dyn(int), bool: _Dyn(bool), complex: _Dyn(complex)}


_SCALARS: dict = {}


def _scalar_array(value, kind):
    """A weakly-typed device scalar for a Python number, cached: converting a Python scalar
    on every call costs more than the op itself."""
    if STATE.trace_depth:
        return value
    key = (kind, value)
    try:
        return _SCALARS[key]
    except KeyError:
        pass
    except TypeError:
        return value
    if len(_SCALARS) > 4096:
        _SCALARS.clear()
    arr = _SCALARS[key] = jnp.asarray(value)
    return arr


def _flat_value(a, leaves, dyn):
    t = type(a)
    if t is TpuTensor:
        leaves.append(array_of(a))
        return _T
    if t is list or t is tuple:
        if a and any(isinstance(x, torch.Tensor) for x in a):
            return tuple(_flat_value(x, leaves, False) for x in a)
        return tuple(a) if t is list else a
    if isinstance(a, torch.Tensor):
        if isinstance(a, TpuTensor):
            leaves.append(array_of(a))
            return _T
        leaves.append(dtypes.torch_to_numpy(a) if HOOKS.host is None else HOOKS.host(a))
        return _C
    if dyn and t in _DYN:
        leaves.append(_scalar_array(a, t))
        return _DYN[t]
    if t is torch.SymInt or t is torch.SymFloat:
        raise NotImplementedError("torchtpu eager ops take concrete sizes, not symbolic ones")
    return a


def flatten(plan: OpPlan, args, kwargs):
    leaves = []
    dyn_pos = plan.dyn_pos
    spec = []
    i = 0
    for a in args:
        if type(a) is TpuTensor:
            arr = a._st.array
            leaves.append(arr if arr is not None and not a._vw and HOOKS.read is None else array_of(a))
            spec.append(_T)
        else:
            spec.append(_flat_value(a, leaves, i in dyn_pos))
        i += 1
    spec = tuple(spec)
    if kwargs:
        dyn_kw = plan.dyn_kw
        kwspec = tuple((k, _flat_value(v, leaves, k in dyn_kw)) for k, v in kwargs.items())
    else:
        kwspec = ()
    return spec, kwspec, leaves


def _unflat_value(s, it):
    if s is _T or s is _C:
        return next(it)
    if type(s) is _Dyn:
        return next(it)
    if type(s) is tuple and s and any(x is _T or x is _C for x in s):
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
    return s


def _meta_args(spec, kwspec, leaves):
    it = iter(leaves)

    def conv(s):
        if s is _T or s is _C or type(s) is _Dyn:
            return _meta_value(s, next(it))
        if type(s) is tuple and s and any(x is _T or x is _C for x in s):
            return [conv(x) for x in s]
        return s

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
    return _decomposition_table().get(func)


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
        with _Tracing():
            targs = _wrap_tracers(args, 0)
            tkwargs = {k: _wrap_tracers(v, 0) for k, v in kwargs.items()}
            out = decomp(*targs, **tkwargs)
            return _unwrap(out)

    return via_decomposition


def _has_composite_implicit(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _composite_implicit(func):
    if _has_composite_implicit(func):
        return lambda *a, **k: func.decompose(*a, **k)
    return None


@functools.lru_cache(maxsize=None)
def _decomposition_table():
    from torch._decomp import decomposition_table

    return decomposition_table


def _trace_body(func, impl, spec, kwspec, random, *leaves):
    """What runs inside jax.jit for one op: lowering + PyTorch's dtype rules."""
    STATS.misses += 1
    if _LOG_RECOMPILES:
        shapes = [tuple(getattr(x, "shape", ())) for x in leaves]
        print(f"[torchtpu] compiling {func} for shapes {shapes}", file=sys.stderr)
    if random:
        key_leaf = leaves[-1]
        leaves = leaves[:-1]
    args, kwargs = unflatten(spec, kwspec, leaves)
    expected = expected_outputs(func, spec, kwspec, leaves)
    if random:
        kwargs["key"] = jax.random.wrap_key_data(key_leaf)
    with _Tracing():
        out = impl(args, kwargs)
    return conform(out, expected)


def run(plan: OpPlan, func, args, kwargs):
    """Compute the functional outputs of `func` as JAX arrays."""
    spec, kwspec, leaves = flatten(plan, args, kwargs)
    impl = plan.impl
    if impl is None:
        impl = plan.impl = _impl_for(plan, func)
    if plan.random:
        from . import random as tpu_random

        leaves.append(tpu_random.next_key_data(_device_index_of(args, kwargs)))
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
    key = (spec, kwspec)
    exes = plan.executables
    try:
        exe = exes[key]
    except KeyError:
        try:
            hash(key)
        except TypeError:
            raise NotImplementedError(f"torchtpu: unhashable static argument in {func}: {spec} {kwspec}")
        exe = exes[key] = jax.jit(functools.partial(_trace_body, func, impl, spec, kwspec, plan.random))
    STATS.calls += 1
    if CONFIG.sync_dispatch:
        return jax.block_until_ready(exe(*leaves))
    return exe(*leaves)


def _impl_for(plan, func):
    # cached by the caller on plan.impl (one plan per op)
    impl = implementation(func)
    if impl is None:
        raise _unsupported(func)
    return impl


class UnsupportedOp(NotImplementedError):
    pass


def _unsupported(func):
    return UnsupportedOp(
        f"torchtpu has no lowering for the ATen operator '{func}' (schema: {func._schema}). "
        "Set TORCHTPU_CPU_FALLBACK=1 to run it on the CPU instead, or report it at the torchtpu issue tracker."
    )


def _device_index_of(args, kwargs):
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
            return v.index or 0
    return 0


# ----------------------------------------------------------------------------- wrapping outputs


def wrap(out, device_index):
    if out is None:
        return None
    if isinstance(out, (list, tuple)):
        return type(out)(wrap(o, device_index) for o in out)
    if isinstance(out, (jax.Array, jax.core.Tracer)):
        return new_base(out, device_index)
    if isinstance(out, np.ndarray):
        return new_base(jnp.asarray(out), device_index)
    return out


# ----------------------------------------------------------------------------- handlers


def dispatch(func, args, kwargs):
    try:
        plan = func._tpu_plan
    except AttributeError:
        plan = func._tpu_plan = plan_for(func)
    try:
        kind = plan.kind
        if kind == "functional":
            out = run(plan, func, args, kwargs)
            if plan.like and not STATE.trace_depth:
                out = _keep_layout(args[0], out)
            if type(out) is _ArrayImpl:
                a0 = args[0] if args else None
                out = new_base(out, a0._st.device_index if type(a0) is TpuTensor else _device_index_of(args, kwargs))
            else:
                if plan.int_returns:  # SymInt returns left jit as arrays
                    out = list(out)
                    for i in plan.int_returns:
                        out[i] = int(out[i]) if not isinstance(out[i], jax.core.Tracer) else out[i]
                    out = tuple(out)
                out = wrap(out, _device_index_of(args, kwargs))
            if plan.like and type(args[0]) is TpuTensor and args[0]._st.dist is not None and type(out) is TpuTensor:
                out._st.dist = args[0]._st.dist
            if plan.post is not None:
                out = plan.post(args, out)
        elif kind == "view":
            out = _view(plan, func, args, kwargs)
        elif kind == "mutating":
            out = _mutating(plan, func, args, kwargs)
        elif kind == "inplace_view":
            out = _inplace_view(plan, func, args, kwargs)
        elif kind == "composite":
            return func.decompose(*args, **kwargs)
        else:
            out = _CUSTOM[func](args, kwargs)
    except UnsupportedOp:
        if CONFIG.cpu_fallback:
            return cpu_fallback(func, args, kwargs)
        raise
    if CONFIG.debug and not STATE.trace_depth:
        check_finite(func, out)
    return out


def _keep_layout(src, out):
    if type(src) is TpuTensor and type(out) is _ArrayImpl:
        sharding = array_of(src).sharding
        if len(sharding.device_set) > 1 and out.sharding != sharding:
            return jax.device_put(out, sharding)
    return out


def _kwarg_or_arg(plan, args, kwargs, i):
    if i < len(args):
        return args[i]
    return kwargs.get(plan.arg_names[i])


def _mutating(plan: OpPlan, func, args, kwargs):
    targets = []  # (tensor, is_list)
    for i in plan.mutated:
        targets.append(_kwarg_or_arg(plan, args, kwargs, i))
    if plan.lowering is not None:
        # Lowering returns (returns..., new values of mutated args in schema order).
        out = run(plan, func, args, kwargs)
        n_ret = len(plan.returns_alias)
        new_values = list(out[n_ret:]) if isinstance(out, (tuple, list)) else []
        rets = out[:n_ret] if isinstance(out, (tuple, list)) else [out]
        for t, new in zip(targets, new_values):
            _write_any(t, new)
        return _returns(plan, args, kwargs, rets)
    if plan.functional is None:
        raise _unsupported(func)
    fplan = plan_for(plan.functional)
    fargs, fkwargs = _strip_outs(plan, args, kwargs)
    result = run(fplan, plan.functional, fargs, fkwargs)
    results = result if isinstance(result, (tuple, list)) else [result]
    if len(targets) == 1 and isinstance(targets[0], (list, tuple)):
        # _foreach_X_: one list argument mutated by a functional returning a list
        for t, new in zip(targets[0], results):
            _write_any(t, new)
        return _returns(plan, args, kwargs, [])
    for t, new in zip(targets, results):
        _write_any(t, new, resize=func._schema.overload_name.startswith("out") or "out" in plan.arg_names)
    return _returns(plan, args, kwargs, [None] * len(plan.returns_alias))


def _strip_outs(plan, args, kwargs):
    """Arguments for the functional variant: no out= tensors, and every positional argument
    spelled out (an in-place overload's default, like bernoulli_'s p=0.5, may be required
    by its functional twin)."""
    outs = {plan.arg_names[i] for i in plan.mutated if func_arg_is_kwarg_only(plan, i)}
    schema_args = plan.func._schema.arguments
    positional = [a for a in schema_args if not a.kwarg_only]
    if len(args) < len(positional):
        args = list(args)
        for a in positional[len(args):]:
            if a.name in kwargs:
                args.append(kwargs[a.name])
            elif a.has_default_value():
                args.append(a.default_value)
            else:
                break
        kwargs = {k: v for k, v in kwargs.items() if k not in {a.name for a in positional}}
    return args, {k: v for k, v in kwargs.items() if k not in outs}


def func_arg_is_kwarg_only(plan, i):
    return plan.func._schema.arguments[i].kwarg_only


def _write_any(t, new, resize=False):
    if t is None:
        return
    if not isinstance(t, TpuTensor):
        if isinstance(t, torch.Tensor):
            # A CPU tensor mutated by a tpu op (for example a CPU `out=`): copy back.
            with no_dispatch():
                t.copy_(dtypes.numpy_to_torch(np.asarray(new), t.dtype))
            return
        return
    want = tuple(t.shape)
    if tuple(new.shape) != want:
        if resize:
            resize_tensor(t, tuple(new.shape))
        else:
            new = jnp.broadcast_to(new, want)
    jdt = dtypes.to_jax_dtype(t.dtype)
    if new.dtype != jdt:
        src = dtypes.to_torch_dtype(new.dtype)
        if not torch.can_cast(src, t.dtype) and not STATE.trace_depth and not getattr(t, "_tt_allow_cast", False):
            raise RuntimeError(f"result type {_pretty(src)} can't be cast to the desired output type {_pretty(t.dtype)}")
        new = cast(new, jdt)
    write(t, new)


def _pretty(dt):
    return {torch.float32: "Float", torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
            torch.bool: "Bool", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.complex64: "ComplexFloat"}.get(dt, str(dt))


@functools.lru_cache(maxsize=None)
def _cast_fn(dtype):
    return jax.jit(lambda a: a.astype(dtype))


def cast(a, jdt):
    if STATE.trace_depth or isinstance(a, jax.core.Tracer):
        return a.astype(jdt)
    return _cast_fn(jdt)(a)


def _returns(plan, args, kwargs, rets):
    outs = []
    for k, alias in enumerate(plan.returns_alias):
        if alias is not None:
            outs.append(_kwarg_or_arg(plan, args, kwargs, alias))
        else:
            outs.append(wrap(rets[k], _device_index_of(args, kwargs)))
    if not outs:
        return None
    if len(outs) == 1 and len(plan.func._schema.returns) == 1:
        return outs[0]
    return tuple(outs)


def resize_tensor(t: TpuTensor, shape):
    """Resize `t` in place (for out= arguments): new metadata, fresh storage."""
    if t._vw:
        raise RuntimeError("torchtpu cannot resize a view; pass a base tensor as out=")
    # resize_'s meta kernel asserts a meta tensor; set_ re-describes the wrapper instead.
    _set_meta(t, aten.set_.source_Storage_storage_offset,
              (t, t.untyped_storage(), 0, list(shape), list(contiguous_strides(tuple(shape)))), {})
    st = t._st
    st.shape = tuple(shape)
    st.array = None
    st.order = None
    st.version += 1


def _set_meta(t, func, args, kwargs):
    """Run a metadata-changing op's meta kernel on the wrapper itself (sizes/strides only)."""
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


# ----------------------------------------------------------------------------- views

_VIEW_META: dict = {}


def _view_statics(args, kwargs):
    return tuple(_freeze(a) for a in args[1:]), tuple((k, _freeze(v)) for k, v in kwargs.items())


def _freeze(a):
    if isinstance(a, list):
        return tuple(a)
    return a


# Views with the base's exact geometry whose values still differ (the conjugate view).
_VALUE_CHANGING_VIEWS = {aten._conj.default, aten.conj.default, aten._neg_view.default}


def _view(plan: OpPlan, func, args, kwargs):
    base = args[0]
    if not isinstance(base, TpuTensor):
        raise _unsupported(func)
    statics, kwstatics = _view_statics(args, kwargs)
    if kwstatics:
        # normalise keyword arguments into positional statics
        names = plan.arg_names[1:]
        full = list(statics) + [None] * (len(names) - len(statics))
        schema_args = func._schema.arguments[1:]
        for j, a in enumerate(schema_args):
            if j >= len(statics):
                full[j] = a.default_value if a.has_default_value() else None
        for k, v in kwstatics:
            full[names.index(k)] = v
        statics = tuple(full)
    key = (func, tuple(base.shape), base.stride(), base.storage_offset(), base.dtype, statics)
    meta = _VIEW_META.get(key)
    if meta is None:
        if func not in LOWERINGS:
            raise _unsupported(func)
        m = torch.empty_strided(
            (_meta_storage_numel(base),), (1,), dtype=base.dtype, device="meta"
        ).as_strided(tuple(base.shape), base.stride(), base.storage_offset())
        with no_dispatch():
            out = func(m, *statics)
        if isinstance(out, (list, tuple)):
            meta = [(tuple(o.shape), o.stride(), o.storage_offset(), o.dtype) for o in out]
        else:
            meta = (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype)
        _VIEW_META[key] = meta
    st = base._st
    if (type(meta) is tuple and meta == (tuple(base.shape), base.stride(), base.storage_offset(), base.dtype)
            and func not in _VALUE_CHANGING_VIEWS):
        # alias, detach, same-shape view/expand...: the same elements of the same storage,
        # so no extra view step (parameters stay bases, and optimizer updates stay cheap)
        return TpuTensor(st, base._vw, meta[0], meta[3], strides=meta[1], offset=meta[2])
    if isinstance(meta, list):
        return [
            TpuTensor(st, base._vw + ((func, statics, i),), s, d, strides=stride, offset=off)
            for i, (s, stride, off, d) in enumerate(meta)
        ]
    s, stride, off, d = meta
    step = (func, statics, None)
    if func in _STORAGE_RELATIVE and storage_order(st) is not None:
        if st.order is NOT_DENSE:
            raise NotImplementedError(
                f"torchtpu: as_strided on a tensor made with strides {tuple(base.stride())} that leave gaps or "
                "overlap; make it with contiguous strides (torch.empty) or call .contiguous() first")
        step = step + (st.order,)
    return TpuTensor(st, base._vw + (step,), s, d, strides=stride, offset=off)


def _meta_storage_numel(t) -> int:
    """Elements of the meta storage a view's metadata is computed on: the base's, with room
    for dtype views (view.dtype) that change the element size."""
    n = 1
    for d in t._st.shape:
        n *= d
    return max(n * 8, 1)


def _inplace_view(plan: OpPlan, func, args, kwargs):
    t = args[0]
    name = func._schema.name.split("::")[1]
    if name == "detach_":
        return t
    packet = getattr(aten, name.rstrip("_"))
    names = [a.name for a in func._schema.arguments]
    fop = next(
        (getattr(packet, o) for o in packet.overloads()
         if [a.name for a in getattr(packet, o)._schema.arguments] == names),
        None,
    )
    if fop is None:
        raise _unsupported(func)
    view = _view(plan_for(fop), fop, args, kwargs)
    _set_meta(t, func, args, kwargs)
    t._vw = view._vw
    t._vc = None
    t._vv = -1
    return t


# ----------------------------------------------------------------------------- CPU fallback

_WARNED: set = set()


def to_cpu(x):
    if isinstance(x, TpuTensor):
        a = np.asarray(array_of(x))
        return dtypes.numpy_to_torch(a, x.dtype).reshape(tuple(x.shape))
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x


def _to_tpu_like(x, device_index):
    if isinstance(x, torch.Tensor) and not isinstance(x, TpuTensor):
        return new_base(place(dtypes.torch_to_numpy(x.contiguous()), device_index), device_index, x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_tpu_like(v, device_index) for v in x)
    return x


def cpu_fallback(func, args, kwargs):
    if func not in _WARNED:
        _WARNED.add(func)
        warnings.warn(f"torchtpu: running {func} on the CPU (TORCHTPU_CPU_FALLBACK=1); it has no XLA lowering", stacklevel=3)
    index = _device_index_of(args, kwargs)
    cargs = to_cpu(list(args))
    ckwargs = {k: to_cpu(v) for k, v in kwargs.items()}
    if "device" in ckwargs and isinstance(ckwargs["device"], torch.device) and ckwargs["device"].type == "tpu":
        ckwargs["device"] = torch.device("cpu")
    with no_dispatch():
        out = func(*cargs, **ckwargs)
    plan = plan_for(func)
    for i in plan.mutated:
        tgt = _kwarg_or_arg(plan, args, kwargs, i)
        src = _kwarg_or_arg(plan, cargs, ckwargs, i)
        if isinstance(tgt, TpuTensor):
            write(tgt, jnp.asarray(dtypes.torch_to_numpy(src.contiguous())))
    if plan.mutated:
        return _returns(plan, args, kwargs, [None] * len(plan.returns_alias))
    return _to_tpu_like(out, index)


# ----------------------------------------------------------------------------- debug mode


class NonFiniteError(FloatingPointError):
    pass


def _user_frame():
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename
        if "/torchtpu/" in f or "/torch/" in f or "/jax/" in f or f.startswith("<"):
            continue
        return frame
    return None


def check_finite(func, out):
    outs = out if isinstance(out, (list, tuple)) else [out]
    for o in outs:
        if isinstance(o, TpuTensor) and (o.dtype.is_floating_point or o.dtype.is_complex):
            a = array_of(o)
            a.block_until_ready()
            if not bool(jnp.all(jnp.isfinite(a))):
                frame = _user_frame()
                where = f" at {frame.filename}:{frame.lineno}: {linecache.getline(frame.filename, frame.lineno).strip()}" if frame else ""
                kind = "NaN" if bool(jnp.any(jnp.isnan(a))) else "Inf"
                raise NonFiniteError(f"torchtpu debug mode: {func} produced {kind}{where}")


# ----------------------------------------------------------------------------- repr


def tensor_repr(t: TpuTensor) -> str:
    with torch._C.DisableTorchFunctionSubclass():
        cpu = to_cpu(t)
    body = repr(cpu)
    assert body.endswith(")")
    extras = [f"device='{t.device}'"]
    if t.grad_fn is not None:
        extras.append(f"grad_fn=<{type(t.grad_fn).__name__}>")
    elif t.requires_grad:
        extras.append("requires_grad=True")
    return body[:-1] + ", " + ", ".join(extras) + ")"


from . import tensor as _tensor_module  # noqa: E402

_tensor_module._dispatch = dispatch
