"""PyTorch's distributed checkpoint (`torch.distributed.checkpoint`, DCP) on tpu: async saves stage
tpu tensors by their values.

`dcp.save` and `dcp.load` need only PyTorch's device contract: a save copies each tensor to the host
(`.to("cpu")`), a load copies each stored chunk into the state dict's own tensors
(`narrow(...).detach().copy_(...)`). An async save (`dcp.async_save`, which torchtitan's checkpoint
`async_mode` "async" and "async_with_pinned_mem" use) first stages the whole state dict in host
memory with DCP's `StateDictStager`, which copies a tensor's *storage*: it allocates a CPU storage of
the same size and copies the device storage's bytes into it. A tpu tensor's values live in a
`jax.Array`, not in storage bytes that PyTorch can copy, and the stager passes over tensors whose
`data_ptr()` is 0: it would return an uninitialised CPU tensor of the right shape, written to the
checkpoint as it is, after deep-copying the tensor's attributes (its array among them, a copy in
device memory). Here a tpu tensor is staged as a CPU copy of its values, in shared memory when the
stager shares memory (the checkpoint process of "async_with_pinned_mem" reads it), which is what a
CUDA tensor's storage copy gives; every other tensor takes DCP's own path.
"""

from __future__ import annotations

from ..backend import TpuTensor
from .on_import import patch_on_import

_PATCHED = "_torchtpu"
# TpuTensor's own attributes (its storage, view chain and cached view read): the staged CPU tensor
# holds the values, so these are not copied to it as a tensor subclass's other attributes are
_DEVICE_ATTRS = frozenset(("_st", "_vw", "_vc", "_vv"))


def _patch_stager(module) -> None:
    stager = module.StateDictStager
    original = stager._offload_tensor
    if getattr(original, _PATCHED, False):
        return

    def _offload_tensor(self, x, memo, non_blocking=False):
        if not isinstance(x, TpuTensor):
            return original(self, x, memo, non_blocking=non_blocking)
        y = x.detach().cpu()
        if self.share_memory:
            y.share_memory_()
        memo[id(x)] = y
        for name, value in x.__dict__.items():
            if name not in _DEVICE_ATTRS:
                setattr(y, name, self.deepcopy_with_tensor_offload(value, memo, non_blocking=non_blocking))
        return y

    setattr(_offload_tensor, _PATCHED, True)
    stager._offload_tensor = _offload_tensor


_PATCHES = {"torch.distributed.checkpoint._state_dict_stager": _patch_stager}


def install() -> None:
    patch_on_import(_PATCHES)
