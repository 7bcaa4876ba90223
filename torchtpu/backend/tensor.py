"""The tensor type behind the `tpu` device.

A `TpuTensor` is a wrapper subclass: PyTorch sees an ordinary tensor on `tpu:N` (sizes,
strides, dtype, autograd), and the data lives in a `jax.Array`.

Views alias through a shared `Storage`. The storage holds the array of the *base* tensor
(always contiguous). A view records the chain of view ops that reads it from that array;
reading applies the chain, writing scatters back through it. In-place ops on bases, which is
what optimizers do to parameters, simply replace `storage.array` (views.py reads and writes).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import torch

from . import dtypes
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
    """The internal index of the user's tpu:`user_index`."""
    own = _OWN[0]
    if own is None or user_index == own:
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

    __slots__ = ("array", "version", "shape", "dtype", "device_index", "dist", "order", "rows", "__weakref__")

    def __init__(self, array, shape, dtype, device_index):
        self.array = array
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
        if HOOKS.create is not None:
            HOOKS.create(self)


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
            (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad),
        )


def new_base(array, device_index: int, dtype: torch.dtype | None = None) -> TpuTensor:
    """Wrap a fresh JAX array as a tpu base tensor (the hot path of every op)."""
    shape = array.shape
    if dtype is None:
        dtype = _JAX_TO_TORCH.get(array.dtype) or dtypes.to_torch_dtype(array.dtype)
    r = torch.Tensor._make_wrapper_subclass(TpuTensor, shape, dtype=dtype, device=torch_device(device_index))
    r._st = Storage(array, shape, dtype, device_index)
    return r


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
    if device_index == 0:
        return jax.device_put(x)
    return jax.device_put(x, jax.devices()[device_index])


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
