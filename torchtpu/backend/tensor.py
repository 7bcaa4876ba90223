"""The tensor type behind the `tpu` device.

A `TpuTensor` is a wrapper subclass: PyTorch sees an ordinary tensor on `tpu:N` (sizes,
strides, dtype, autograd), and the data lives in a `jax.Array`.

Views alias through a shared `Storage`. The storage holds the array of the *base* tensor
(always contiguous). A view records the chain of view ops that reads it from that array;
reading applies the chain, writing scatters back through it. In-place ops on bases, which is
what optimizers do to parameters, simply replace `storage.array` (views.py reads and writes).
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.array import ArrayImpl as _ArrayImpl  # the concrete jax.Array type

from . import dtypes
from .fused import Deferred
from .heap import note_host_bytes
from .state import HOOKS

_DEVICES: dict[int, torch.device] = {}
# The user's index of internal device 0 under torchrun's one-chip-per-process rule (LOCAL_RANK), else
# None. Internally a storage's device_index counts this process's devices from 0 (0: its first);
# users see and name devices by their own numbering, which differs only under that rule.
_OWN: list[int | None] = [None]


def set_own_index(rank: int | None) -> None:
    _OWN[0] = rank
    _DEVICES.clear()


def torch_device(index: int) -> torch.device:
    """The torch.device of internal index `index`."""
    d = _DEVICES.get(index)
    if d is None:
        d = _DEVICES[index] = torch.device("tpu", index if _OWN[0] is None else _OWN[0] + index)
    return d


def internal_index(user_index: int) -> int:
    """The internal index of the user's tpu:`user_index`. Under the one-chip rule index 0 names
    the process's device too: PyTorch's C++ fills a device given without an index (`.to("tpu")`)
    with its device guard's current index, which a Python backend's guard cannot keep (always 0)."""
    own = _OWN[0]
    if own is None or user_index in (own, 0):
        return 0 if own is not None else user_index
    raise RuntimeError(
        f"tpu:{user_index} is another process's chip: under torchrun each process owns one tpu device, "
        f"and this one (LOCAL_RANK={own}) owns tpu:{own}. Use f'tpu:{{LOCAL_RANK}}' or plain 'tpu'"
    )


_STRIDES: dict = {}


def contiguous_strides(shape) -> tuple:
    s = _STRIDES.get(shape)
    if s is None:
        acc = 1
        out = []
        for n in reversed(shape):
            out.append(acc)
            acc *= max(n, 1)
        s = _STRIDES[shape] = tuple(reversed(out))
    return s


class Layout(NamedTuple):
    """How torchtpu.distributed laid a storage out: the DeviceMesh and placements it was
    given (None for a layout that only has a sharding), and the jax Sharding they map to."""

    mesh: object
    placements: tuple | None
    sharding: jax.sharding.Sharding


class Storage:
    """What a base tensor and all its views share.

    `array` is None for memory that was allocated but never written (torch.empty); it reads
    as zeros. `version` changes on every write so views know when their cached read is stale.
    """

    __slots__ = ("_array", "version", "shape", "dtype", "device_index", "dist", "order", "rows", "ident", "__weakref__")

    def __init__(self, array, shape, dtype, device_index):
        if device_index and type(array) is _ArrayImpl and not array._committed:
            array = _placed(array, device_index)
        self._array = array
        self.version = 0
        self.shape = shape
        self.dtype = dtype
        self.device_index = device_index
        self.dist: Layout | None = None  # given by torchtpu.distributed
        # rows=True: a stack of equal parameters whose rows are the tensors in use (the layer
        # scan's stacked storage); a row is read and written by index (views.run_chain)
        self.rows = False
        # `order` (set only when the base's strides are not row-major, so that the hot path
        # of every op pays nothing for it; read it with storage_order): how PyTorch would lay
        # the base out in memory (torch.empty_strided, a strided tensor moved with
        # .to("tpu")), see memory_order. `array` always holds the logical values; only
        # as_strided reads memory positions.
        # `ident` (set on first ask, read with storage_identity): the torch.UntypedStorage that
        # stands for this storage in PyTorch's API.
        if HOOKS.create is not None:
            HOOKS.create(self)

    # In fused mode (backend.fused) the array may be a Deferred value of ops still to run:
    # reading it here runs them, so every reader but the recording path gets an array.
    @property
    def array(self):
        a = self._array
        if type(a) is Deferred:
            a = self._array = a.get()
        return a

    @array.setter
    def array(self, value):
        if self.device_index and type(value) is _ArrayImpl and not value._committed:
            value = _placed(value, self.device_index)
        self._array = value

    def pending_array(self):
        """The array, or the Deferred value standing for it in fused mode (backend.fused)."""
        a = self._array
        if type(a) is Deferred and a.value is not None:
            a = self._array = a.value
        return a


# Storage identity. A tpu storage has no host memory for PyTorch to point at, yet code that looks for
# tensors sharing memory reads addresses: safetensors and transformers' save_pretrained group tensors by
# `untyped_storage().data_ptr()` and `nbytes()`, then compare `data_ptr()` ranges; torch.save and
# deepcopy keep shared storage shared. Each Storage gets, the first time it is asked, an address range
# of its own, [address, address + nbytes), from a range no host pointer uses (2**56 up, never given
# twice), and a torch.UntypedStorage of that address and size: the same object for the base and all
# its views, so a view's data_ptr() is the address plus storage_offset() elements, as on CPU. The
# address is an identity, not memory: nothing reads through it (a storage-level read, such as
# `untyped_storage().cpu()`, raises in the tpu dispatcher).
_NEXT_ADDRESS = [1 << 56]


def storage_identity(st: Storage) -> torch.UntypedStorage:
    """The torch.UntypedStorage standing for `st`: its address and byte size (see above)."""
    ident = getattr(st, "ident", None)
    if ident is None:
        nbytes = st.dtype.itemsize
        for n in st.shape:
            nbytes *= n
        address = _NEXT_ADDRESS[0]
        _NEXT_ADDRESS[0] += -(-max(nbytes, 1) // 64) * 64
        ident = st.ident = torch._C._construct_storage_from_data_pointer(address, torch_device(st.device_index), nbytes)
    return ident


def copy_storage(st: Storage) -> Storage:
    """A storage with the values and layout of `st` in a buffer of its own."""
    new = Storage(None if st.array is None else _copy_array(st.array), st.shape, st.dtype, st.device_index)
    new.dist = st.dist
    new.rows = st.rows
    order = getattr(st, "order", None)
    if order is not None:
        new.order = order
    return new


_copy_array = jax.jit(jnp.copy)
# (Storage, its version) -> the CPU copy of its values that one pickling pass gives every tensor of it
_HOST_COPIES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_OWN_ATTRS = frozenset(("_st", "_vw", "_vc", "_vv"))


class TpuTensor(torch.Tensor):
    # _st: Storage; _vw: tuple of view steps from the storage's array (() for a base);
    # _vc/_vv: cached read of a view and the storage version it was read at.

    @staticmethod
    def __new__(cls, storage: Storage, view: tuple, shape, dtype, strides=None, offset=0, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=contiguous_strides(tuple(shape)) if strides is None else strides,
            storage_offset=offset,
            dtype=dtype,
            device=torch_device(storage.device_index),
            requires_grad=requires_grad,
        )
        r._st = storage
        if view:
            r._vw = view
        return r

    def __init__(self, *args, **kwargs):
        pass

    _vw = ()
    _vc = None
    _vv = -1
    # No Python-level torch function layer: everything is handled below autograd.
    __torch_function__ = torch._C._disabled_torch_function_impl

    # __torch_dispatch__ and __repr__ are given by handlers.py: the dispatcher is built on
    # this module, so this module cannot import it.

    # DTensor's methods, answered by the sharding layer (torchtpu.distributed.dtensor), which
    # gives its functions with register_dtensor_methods: the backend sits below it.
    @property
    def placements(self):
        return _dtensor_method("placements")(self)

    @property
    def device_mesh(self):
        return _dtensor_method("device_mesh")(self)

    def redistribute(self, *args, **kwargs):
        return _dtensor_method("redistribute")(self, *args, **kwargs)

    def full_tensor(self, *args, **kwargs):
        return _dtensor_method("full_tensor")(self, *args, **kwargs)

    def to_local(self, *args, **kwargs):
        return _dtensor_method("to_local")(self, *args, **kwargs)

    # `param.data = new` replaces a tensor's contents while keeping the object (its identity,
    # autograd hooks and grad). PyTorch's setter copies the TensorImpl's fields (sizes, dtype);
    # the values of a tpu tensor live on the Python object, so they follow here.
    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new):
        _TENSOR_DATA.__set__(self, new)  # raises for a tensor of another device
        self._st = new._st
        self._vw = new._vw
        self._vc = None
        self._vv = -1

    def tolist(self):
        return self.cpu().tolist()

    def untyped_storage(self):
        return storage_identity(self._st)

    def data_ptr(self):
        return storage_identity(self._st).data_ptr() + self.storage_offset() * self.element_size()

    def __deepcopy__(self, memo):
        # PyTorch's rule for tensors (torch.Tensor.__deepcopy__), with the storage copied once per
        # deepcopy: tensors that share a storage share its copy (tied weights stay tied).
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "deepcopy of a tpu tensor that autograd computed: as for any PyTorch tensor, only graph leaves "
                "(tensors the user created) can be deep-copied; deepcopy its .detach() instead"
            )
        st = self._st
        new_st = memo.get(id(st))
        if new_st is None:
            new_st = memo[id(st)] = copy_storage(st)
            memo.setdefault(id(memo), []).append(st)  # deepcopy's keep-alive list: ids stay unique
        new = TpuTensor(
            new_st,
            self._vw,
            tuple(self.shape),
            self.dtype,
            strides=self.stride(),
            offset=self.storage_offset(),
            requires_grad=self.requires_grad,
        )
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        attrs = {k: v for k, v in self.__dict__.items() if k not in _OWN_ATTRS}
        if attrs:
            new.__dict__.update(copy.deepcopy(attrs, memo))
        return new

    def numpy(self, *, force: bool = False):
        # CUDA's rule: a device tensor is copied to the host explicitly; force=True does it here
        if force:
            return self.detach().cpu().resolve_conj().resolve_neg().numpy()
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
            "host memory first."
        )

    def __reduce_ex__(self, proto):
        # Serialise like any storage-less accelerator tensor: a CPU copy plus a device string
        # that honours torch.load(map_location=...) and that weights_only loading accepts.
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self._host_copy(), self.dtype, str(self.device), self.requires_grad),
        )

    def _host_copy(self) -> torch.Tensor:
        """A CPU tensor with this tensor's values. Within one pickling pass (torch.save), the tensors
        of one storage get views of one CPU copy of the whole storage, as PyTorch saves CPU tensors
        that share memory: the file holds the storage once, and loading it on the CPU gives tensors
        that share memory again."""
        st = self._st
        if st.dtype != self.dtype or getattr(st, "order", None) is not None or self.is_conj() or self.is_neg():
            return self.detach().cpu()
        key = (st, st.version)
        host = _HOST_COPIES.get(key)
        if host is None:
            host = _HOST_COPIES[key] = TpuTensor(st, (), st.shape, st.dtype).cpu()
        if tuple(self.shape) == tuple(host.shape) and self.stride() == host.stride() and not self.storage_offset():
            return host
        return host.as_strided(tuple(self.shape), self.stride(), self.storage_offset())


_DTENSOR_METHODS: dict = {}  # name -> fn(tensor, ...): TpuTensor's DTensor methods


def register_dtensor_methods(*, placements, device_mesh, redistribute, full_tensor, to_local) -> None:
    """Give TpuTensor its DTensor methods (`t.placements`, `t.device_mesh`, `t.redistribute(...)`,
    `t.full_tensor()`, `t.to_local()`): each function takes the tensor first."""
    _DTENSOR_METHODS.update(
        placements=placements,
        device_mesh=device_mesh,
        redistribute=redistribute,
        full_tensor=full_tensor,
        to_local=to_local,
    )


def _dtensor_method(name: str):
    fn = _DTENSOR_METHODS.get(name)
    if fn is None:
        raise AttributeError(f"TpuTensor.{name}: the DTensor methods come with torchtpu.distributed; import torchtpu")
    return fn


def new_base(array, device_index: int, dtype: torch.dtype | None = None) -> TpuTensor:
    """Wrap a fresh JAX array as a tpu base tensor (the hot path of every op)."""
    shape = array.shape
    if dtype is None:
        dtype = _JAX_TO_TORCH.get(array.dtype) or dtypes.to_torch_dtype(array.dtype)
    r = torch.Tensor._make_wrapper_subclass(TpuTensor, shape, dtype=dtype, device=torch_device(device_index))
    r._st = Storage(array, shape, dtype, device_index)
    return r


def _placed(array, device_index: int):
    """`array`, an op's result for tpu:`device_index` that XLA put on its default device (an op
    reading no array of that device: a factory such as `torch.zeros(n, device="tpu:1")`, or
    `zeros_like`), committed to that device as `place` commits what moves there, so it lives on
    the chip its device names and meets tensors of other devices with PyTorch's error. Under a
    launcher that gives each process one device, whatever index names it, it stays as it is."""
    device = _other_device(device_index)
    return array if device is None else jax.device_put(array, device)


@functools.cache
def _other_device(device_index: int):
    """The JAX device of tpu:`device_index` where it is not the process's first device, else None."""
    device = jax_device(device_index)
    return None if device == jax_device(0) else device


_TENSOR_DATA = torch._C.TensorBase.data
_JAX_TO_TORCH = dtypes.JAX_TO_TORCH


def jax_device(device_index: int):
    """The JAX device of tpu:`device_index`: index 0 is this process's first device (JAX's default
    device, which in a job of several processes is not the job's device 0), other indices are the
    job's devices in `jax.devices()` order."""
    return jax.local_devices()[0] if device_index == 0 else jax.devices()[device_index]


def place(x, device_index: int):
    """Put host data (or an array) on tpu:`device_index`.

    tpu:0 arrays stay *uncommitted* on JAX's default device, so that they combine with arrays
    laid out over a whole device mesh (a batch made with `.to("tpu")` meets sharded
    parameters); arrays on other indices are committed to their device."""
    if type(x) is np.ndarray:
        note_host_bytes(x.nbytes)
    if device_index == 0:
        if type(x) is np.ndarray:
            return _put_host(x)
        if type(x) is _ArrayImpl and not x.committed and jax.config.jax_default_device is None:
            return x  # where jax.device_put(x) leaves it, without its 15 µs of checks
        return jax.device_put(x)
    return jax.device_put(x, jax.devices()[device_index])


def _put_host(x: np.ndarray):
    """`jax.device_put(x)` of a NumPy array: the same uncommitted array on JAX's default device,
    through XLA's own transfer call (8 µs against 29 for a (8, 64) array: every `.to("tpu")` of a
    batch and `torch.tensor(data, device="tpu")` goes through here). Anything else (a dtype JAX
    would convert, a default device set by `jax.default_device`, 64-bit types turned off) takes
    `jax.device_put`."""
    global _PUT
    if _PUT is None:
        _PUT = _host_put_call()
    # the dtypes torchtpu maps (dtypes.JAX_TO_TORCH), which JAX keeps as they are with 64-bit types on,
    # as torchtpu runs (`_platform`); where a block turns them off, jax.device_put converts them
    if (
        _PUT is False
        or x.dtype not in dtypes.JAX_TO_TORCH
        or not jax.config.jax_enable_x64
        or jax.config.jax_default_device is not None
    ):
        return jax.device_put(x)
    device, sharding = _PUT
    return _batched_device_put(_ShapedArray(x.shape, x.dtype), sharding, [x], [device], False)


def _host_put_call():
    """(device, sharding) for `_put_host`, or False where XLA's call is not the one this was
    written against (then `jax.device_put` is used)."""
    global _batched_device_put, _ShapedArray
    try:
        from jax._src.core import ShapedArray
        from jax._src.lib import xla_client

        device = jax.local_devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        probe = np.arange(3, dtype=np.float32)
        out = xla_client.batched_device_put(ShapedArray(probe.shape, probe.dtype), sharding, [probe], [device], False)
        if type(out) is not type(jax.device_put(probe)) or out.committed or out.tolist() != probe.tolist():
            return False
    except Exception:  # noqa: BLE001 - any change in the private API: the public call instead
        return False
    _batched_device_put, _ShapedArray = xla_client.batched_device_put, ShapedArray
    return device, sharding


_PUT = None
_batched_device_put = _ShapedArray = None


def new_empty(shape, dtype, device_index, strides=None) -> TpuTensor:
    shape = tuple(shape)
    st = Storage(None, shape, dtype, device_index)
    if strides is not None:
        strides = tuple(strides)
        st.order = memory_order(shape, strides)
    return TpuTensor(st, (), shape, dtype, strides=strides)


def memory_order(shape, strides):
    """None for row-major strides; for other dense strides, the permutation of the dims from
    the slowest to the fastest in memory (`array.transpose(order).reshape(-1)` is the memory
    PyTorch would have); NOT_DENSE when the strides leave gaps or overlap."""
    shape, strides = tuple(shape), tuple(strides)
    if len(strides) != len(shape):
        raise RuntimeError(
            f"empty_strided: {len(shape)} sizes {list(shape)} but {len(strides)} strides {list(strides)}"
        )
    if 0 in shape or strides == contiguous_strides(shape):
        return None
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -strides[d])
    expected = 1
    for d in reversed(dims):
        if strides[d] != expected:
            return NOT_DENSE
        expected *= shape[d]
    order = tuple(dims) + tuple(d for d in range(len(shape)) if shape[d] == 1)
    return None if order == tuple(range(len(shape))) else order


NOT_DENSE = "not dense"


def storage_order(st: Storage):
    return getattr(st, "order", None)


def storage_of(t: TpuTensor) -> Storage:
    """The storage `t` (a base or a view) reads its values from."""
    return t._st
