"""Moving data between CPU, tpu devices and JAX: copy_, _to_copy, item, to_jax/from_jax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from . import dtypes
from .fallback import to_cpu
from .fused import record
from .handlers import cast, resize_tensor, set_meta
from .optable import custom
from .state import CONFIG, is_tracing, note_mesh
from .tensor import TpuTensor, internal_index, jax_device, new_base, place, storage_of
from .views import array_of, pending_array_of, write

aten = torch.ops.aten


def _device(index: int):
    return jax_device(index)


def cpu_to_array(t: torch.Tensor, device_index: int):
    a = dtypes.torch_to_numpy(t.contiguous())
    if is_tracing():
        return jnp.asarray(a)
    if _device(device_index).platform == "cpu":
        # XLA:CPU may alias the NumPy buffer: later writes to the CPU tensor must not show
        a = np.array(a, copy=True)
    return place(a, device_index)


@custom(aten.copy_.default)
def copy_tensor(args, kwargs):
    """aten.copy_(self, src): `src` (tpu or CPU) written into `self` (tpu or CPU), broadcast and cast
    to `self`'s shape and dtype."""
    self, src = args[0], args[1]
    if isinstance(self, TpuTensor):
        if isinstance(src, TpuTensor):
            new = array_of(src)
            if storage_of(src).device_index != storage_of(self).device_index and not is_tracing():
                new = jax.device_put(new, _device(storage_of(self).device_index))
        else:
            new = cpu_to_array(src, storage_of(self).device_index)
        jdt = dtypes.to_jax_dtype(self.dtype)
        if tuple(new.shape) != tuple(self.shape):
            new = jnp.broadcast_to(new, tuple(self.shape)) if is_tracing() else _broadcast(new, tuple(self.shape))
        if new.dtype != jdt:
            new = cast(new, jdt)
        write(self, new)
        return self
    # CPU destination, tpu source
    with no_dispatch():
        self.copy_(to_cpu(src))
    return self


_broadcast = jax.jit(jnp.broadcast_to, static_argnums=1)


@custom(aten._to_copy.default)
def _to_copy(args, kwargs):
    x = args[0]
    dtype = kwargs.get("dtype") or x.dtype
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
    if device is not None and device.type == "meta":
        # Shapes only: reading the values would allocate memory never written (torch.empty),
        # e.g. the whole of a model whose parameters are laid out over a mesh afterwards.
        with no_dispatch():
            return torch.empty_strided(tuple(x.shape), x.stride(), dtype=dtype, device="meta")
    if device is not None and device.type != "tpu":
        cpu = to_cpu(x)
        with no_dispatch():
            return cpu.to(dtype=dtype, device=device, copy=False) if cpu.dtype != dtype or device.type != "cpu" else cpu
    own = storage_of(x).device_index
    index = own if device is None or device.index is None else internal_index(device.index)
    recording = CONFIG.fused and index == own == 0 and not is_tracing()
    # fused mode: a cast or copy on the device is recorded (backend.fused)
    src = pending_array_of(x) if recording else array_of(x)
    a = src
    jdt = dtypes.to_jax_dtype(dtype)
    if a.dtype != jdt:
        a = cast(a, jdt)
    if index != own and not is_tracing():
        a = jax.device_put(a, _device(index))
    elif a is src and not is_tracing():
        # A real copy: sharing the buffer would let a donated step invalidate it.
        a = record(_copy_array, (a,)) if recording else _copy_array(a)
    return new_base(a, index, dtype)


_copy_array = jax.jit(jnp.copy)


@custom(aten._local_scalar_dense.default)
def _item(args, kwargs):
    a = array_of(args[0])
    if is_tracing():
        raise RuntimeError(
            "tensor.item() inside a compiled torchtpu program needs the value on the host; "
            "move the .item() call outside the compiled function (or log it asynchronously)"
        )
    v = np.asarray(a).reshape(()).item()
    if args[0].dtype == torch.bool:
        return bool(v)
    return v


@custom(aten.resize_.default)
def _resize_(args, kwargs):
    t, size = args[0], tuple(args[1])
    if tuple(t.shape) != size:
        old = array_of(t) if storage_of(t).array is not None else None
        resize_tensor(t, size)
        if old is not None and old.size:
            n = min(old.size, int(np.prod(size)))
            flat = jnp.zeros((int(np.prod(size)),), old.dtype).at[:n].set(old.reshape(-1)[:n])
            write(t, flat.reshape(size))
    return t


@custom(aten.set_.source_Tensor)
def _set_source_tensor(args, kwargs):
    t, src = args
    # the meta kernel re-describes the wrapper over its own (tpu) storage: a meta source is refused
    set_meta(
        aten.set_.source_Storage_storage_offset,
        (t, torch._C.TensorBase.untyped_storage(t), src.storage_offset(), list(src.shape), list(src.stride())),
        {},
    )
    t._st = storage_of(src)
    t._vw = src._vw
    t._vc = None
    t._vv = -1
    return t


@custom(aten.lift_fresh.default, aten.lift.default)
def _lift_fresh(args, kwargs):
    return args[0]


@custom(aten.is_same_size.default)
def _is_same_size(args, kwargs):
    return tuple(args[0].shape) == tuple(args[1].shape)


@custom(aten._has_compatible_shallow_copy_type.default)
def _compatible(args, kwargs):
    return type(args[0]) is type(args[1])


@custom(aten._has_same_storage_numel.default)
def _same_storage_numel(args, kwargs):
    # forward-mode AD's check that a tangent's storage holds as many elements as its primal's
    def numel(t):
        st = storage_of(t)
        return int(np.prod(st.shape)) * st.dtype.itemsize // t.dtype.itemsize

    return numel(args[0]) == numel(args[1])


@custom(aten.is_pinned.default)
def _is_pinned(args, kwargs):
    return False


def to_jax(t: torch.Tensor) -> jax.Array:
    """The `jax.Array` holding a tpu tensor's values (zero-copy)."""
    if not isinstance(t, TpuTensor):
        raise TypeError(
            f"torchtpu.to_jax expects a tensor on the tpu device, got one on {t.device}; call .to('tpu') first"
        )
    return array_of(t)


def from_jax(a: jax.Array) -> torch.Tensor:
    """A tpu tensor backed by `a` (zero-copy)."""
    if not isinstance(a, (jax.Array, jax.core.Tracer)):
        a = jnp.asarray(a)
    index = 0
    if not isinstance(a, jax.core.Tracer):
        devs = list(a.devices())
        if len(devs) == 1:
            index = jax.devices().index(next(iter(devs)))
        elif isinstance(a.sharding, jax.sharding.NamedSharding):
            note_mesh(a.sharding.mesh)
    return new_base(a, index)
