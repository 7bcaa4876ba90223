"""Reading and writing a tensor's values through its storage and view chain.

A base tensor's values are its storage's array. A view's values are read by applying its
chain of view steps to that array, and written by scattering through the same chain. A view
step is (op, static args, output index[, memory order]); reading applies each op's lowering.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.array import ArrayImpl as _ArrayImpl  # the concrete jax.Array type

from . import dtypes
from .fused import Deferred, constrain, force, record, reshard
from .optable import LOWERINGS
from .state import CONFIG, HOOKS, STATE
from .tensor import Storage, TpuTensor, jax_device

aten = torch.ops.aten


def _zeros_fn(shape, dtype):
    return jnp.zeros(shape, dtype)


_ZEROS = jax.jit(_zeros_fn, static_argnums=(0, 1))


def storage_array(st: Storage):
    """The array of `st` (zeros, made now, for memory never written)."""
    a = st.array
    if HOOKS.read is not None:
        a = HOOKS.read(st, a)
    if a is None:
        jdt = dtypes.to_jax_dtype(st.dtype)
        if STATE.trace_depth:
            a = jnp.zeros(st.shape, jdt)
        elif st.dist is not None:
            a = jnp.zeros(st.shape, jdt, device=st.dist.sharding)  # made in place, never whole on one device
            st.array = a
        else:
            with jax.default_device(jax_device(st.device_index)):
                st.array = _ZEROS(st.shape, jdt)
            a = st.array  # as the storage keeps it (committed to its device: tensor.Storage)
    return a


def array_of(t: TpuTensor):
    """The JAX array holding `t`'s current values."""
    st = t._st
    vw = t._vw
    if not vw:
        a = st.array
        return a if a is not None and HOOKS.read is None else storage_array(st)
    if t._vv == st.version and t._vc is not None and HOOKS.read is None:
        a = t._vc
        if type(a) is Deferred:
            a = t._vc = a.get()
        return a
    base = storage_array(st)
    a = run_chain(vw, base, st.rows)
    # A row of a stacked storage (a layer scan's parameter) is read again rather than kept: kept,
    # the rows of every block would hold a second copy of the model's weights beside the stack
    # (1.2 GB for Qwen3's debugmodel_moe), past every step that replaces the stack.
    if not STATE.trace_depth and not st.rows:
        t._vc = a
        t._vv = st.version
    return a


def pending_array_of(t: TpuTensor):
    """`t`'s current values for an op being recorded in fused mode (backend.fused): an array, or
    a Deferred value; a view of a pending storage is read by a recorded op too."""
    st = t._st
    a = st.pending_array()
    if a is None or HOOKS.read is not None:
        a = storage_array(st)
    vw = t._vw
    if not vw:
        return a
    if t._vv == st.version and t._vc is not None:
        return t._vc
    if _row_of(vw, a, st.rows) is not None:
        a = run_chain(vw, force(a), st.rows)
    else:
        a = record(_jitted_chain(vw), (a,))
    if not st.rows:
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
    elif type(new) is Deferred or type(st.pending_array()) is Deferred:
        base = st.pending_array()
        if base is None:
            base = storage_array(st)
        if _row_of(t._vw, base, st.rows) is None:
            st.array = record(_jitted_scatter(t._vw, False), (base, new))
        else:
            new = force(new)  # runs the recorded graph first, which lets go of the arrays it read
            base = force(base)
            st.pending_array()  # the storage holds the array itself, not a Deferred around it
            alone = sys.getrefcount(base) <= 3  # see below
            st.array = scatter_chain(t._vw, base, new, st.rows, donate=alone)
    else:
        base = storage_array(st)
        # three references: the storage, `base` and getrefcount's argument. Nothing else (a
        # clone sharing the array, a view's cached value, a user's `to_jax`) can read the old
        # array, so the write may update its buffer in place (donated) instead of copying it.
        alone = sys.getrefcount(base) <= 3
        st.array = scatter_chain(t._vw, base, new, st.rows, donate=alone)
    st.version += 1


def _keep_dist_layout(st, new):
    # A write into a tensor laid out over a mesh keeps its layout (as DTensor's in-place ops
    # do): parameters initialised in place stay sharded. In fused mode a pending value is
    # constrained to the layout in its program (backend.fused.constrain).
    old = st.pending_array()
    if type(old) is _ArrayImpl:
        sharding = old.sharding
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return new
    elif type(old) is Deferred and old.sharding is not None:
        sharding = old.sharding
    elif st.dist is not None:
        sharding = st.dist.sharding
    else:
        return new
    if type(new) is Deferred:
        return constrain(new, sharding)
    if type(new) is _ArrayImpl and new.sharding != sharding:
        new = reshard(new, sharding)
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
        if step[0] in STORAGE_RELATIVE:
            a = _apply_step(step, base if len(step) == 3 else jnp.transpose(base, step[3]))
        else:
            a = _apply_step(step, a)
    return a


STORAGE_RELATIVE = {aten.as_strided.default}


@functools.cache
def _jitted_chain(chain):
    return jax.jit(functools.partial(_chain_fn, chain))


def select0_index(chain, shape) -> int | None:
    """i when the view `chain` over a storage of `shape` is exactly `select(0, i)` (a row of a
    stack, as the layer scan's stacked parameters are: distributed.params._materialize_stacked),
    else None; i counted from the front."""
    if len(chain) != 1 or len(chain[0]) != 3 or chain[0][0] is not aten.select.int or chain[0][2] is not None:
        return None
    dim, index = chain[0][1]
    if not shape or dim not in (0, -len(shape)):
        return None
    return index + shape[0] if index < 0 else index


def row_index(t) -> int | None:
    """i when the tensor `t` is row i of its storage (`select(0, i)` of it), else None."""
    if not isinstance(t, TpuTensor) or not t._vw:
        return None
    return select0_index(t._vw, tuple(t._st.shape))


def _row_of(chain, base, rows: bool):
    """For a storage of rows (Storage.rows), the row index when `chain` is `select(0, i)` along its
    unsplit leading dim, else None. Such rows are read and written by programs that take the index
    as an argument: one compile per storage shape instead of one per row, and a write that updates
    the row instead of scattering through an index array of the whole storage (for 80 blocks of a
    70B model, hundreds of compiles at the first init or restore)."""
    if not rows or base.ndim < 2:
        return None
    spec = getattr(getattr(base, "sharding", None), "spec", None)
    if spec is not None and len(spec) and spec[0] is not None:
        return None
    return select0_index(chain, base.shape)


@jax.jit
def _read_row(base, index):
    return jax.lax.dynamic_index_in_dim(base, index, 0, keepdims=False)


def _write_row_fn(base, new, index):
    new = jnp.broadcast_to(new.astype(base.dtype), base.shape[1:])
    return jax.lax.dynamic_update_index_in_dim(base, new, index, 0)


# A row written into a stack the storage alone holds updates it in place (the base donated): a
# copy of the whole stack per write made initialising a layer scan's rows quadratic in depth.
_WRITE_ROW = {False: jax.jit(_write_row_fn), True: jax.jit(_write_row_fn, donate_argnums=0)}


def run_chain(chain, base, rows: bool = False):
    if STATE.trace_depth:
        return _chain_fn(chain, base)
    row = _row_of(chain, base, rows)
    out = _jitted_chain(chain)(base) if row is None else _read_row(base, np.int32(row))
    return jax.block_until_ready(out) if CONFIG.sync_dispatch else out


# Views that only reshape: they read every element of their base in row-major order.
_RESHAPE_VIEWS = {aten.view.default, aten._unsafe_view.default}


def _scatter_fn(chain, base, new):
    if all(len(step) == 3 and step[0] in _RESHAPE_VIEWS for step in chain):
        # a write through reshapes only replaces the whole base: reshaped back, with no index
        # scatter (which XLA cannot split over a mesh: it gathers the update on every device)
        shape = jax.eval_shape(functools.partial(_chain_fn, chain), jax.ShapeDtypeStruct(base.shape, base.dtype)).shape
        return jnp.broadcast_to(new.astype(base.dtype), shape).reshape(base.shape)
    index = jnp.arange(base.size, dtype=jnp.int64).reshape(base.shape)
    target = _chain_fn(chain, index)
    new = jnp.broadcast_to(new.astype(base.dtype), target.shape)
    flat = base.reshape(-1).at[target.reshape(-1)].set(new.reshape(-1))
    return flat.reshape(base.shape)


@functools.cache
def _jitted_scatter(chain, donate: bool = False):
    return jax.jit(functools.partial(_scatter_fn, chain), donate_argnums=0 if donate else ())


def scatter_chain(chain, base, new, rows: bool = False, donate: bool = False):
    """`base` with `new` written through the view `chain`; `donate` gives the program `base`'s
    buffer (the caller replaces every reference to it with the result)."""
    if STATE.trace_depth:
        return _scatter_fn(chain, base, new)
    donate = donate and type(base) is _ArrayImpl
    row = _row_of(chain, base, rows)
    if row is None:
        out = _jitted_scatter(chain, donate)(base, new)
    else:
        out = _WRITE_ROW[donate](base, new, np.int32(row))
    return jax.block_until_ready(out) if CONFIG.sync_dispatch else out
