"""PyTorch's own FSDP2 (`torch.distributed.fsdp.fully_shard`) on tpu tensors over a process-group
mesh (`torch.distributed.device_mesh.init_device_mesh("tpu", (world,))`).

FSDP2 frees a module's unsharded parameters after its forward and backward by resizing the
storage of their all-gather buffers to zero bytes, and gives it back before the next all-gather.
A tpu tensor's values live in a JAX array, not in a PyTorch storage (whose `resize_` refuses
it), so for tpu tensors FSDP2's two storage functions act on the array instead: freeing drops it
(the buffer and the parameter viewing it then read as zeros, memory released), allocating leaves
it to the all-gather, which writes every element. CPU and other devices keep PyTorch's functions.
"""

from __future__ import annotations

from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

from ..backend import TpuTensor

_original_free = _fsdp_param.free_storage
_original_alloc = _fsdp_param.alloc_storage


def _free_storage(tensor) -> None:
    if isinstance(tensor, TpuTensor):
        st = tensor._st  # shared with its views: the unsharded parameter is one
        if st.array is not None:
            st.array = None
            st.version += 1
        return
    _original_free(tensor)


def _alloc_storage(tensor) -> None:
    if isinstance(tensor, TpuTensor):
        return  # a dropped array reads as zeros until the all-gather writes the buffer
    _original_alloc(tensor)


def install() -> None:
    _fsdp_param.free_storage = _free_storage
    _fsdp_param.alloc_storage = _alloc_storage
    _fsdp_param_group.alloc_storage = _alloc_storage
