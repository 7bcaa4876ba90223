"""The tpu device: tensor type, dispatcher, op table, device module.

This package's namespace is what the layers above it (torchtpu.distributed, train, models, serve,
integrations) use of the dispatcher: a tpu tensor and its storage, reading and writing its array,
resharding, the tracing state, registering lowerings and custom handlers, taking an op over,
pinning host tensors. The modules these names come from are the backend's own: an import-linter
contract in pyproject.toml keeps the rest of torchtpu out of them. The backend's features with a
face of their own (compile, aot, activation_checkpoint, transfer, dtypes, random, fused, jax_op,
module_jax, dynamo, flex_attention, ops) are imported as modules.
"""

from . import handlers as _handlers  # noqa: F401  (gives TpuTensor its dispatch)
from .device import device_memory_stats, mark_pinned
from .device import register as register_device
from .optable import custom, lower, post
from .overrides import override_op
from .state import CONFIG, STATS, is_tracing, note_mesh, tracing
from .tensor import (
    Layout,
    Storage,
    TpuTensor,
    internal_index,
    new_base,
    new_empty,
    register_dtensor_methods,
    storage_of,
    storage_order,
    torch_device,
)
from .views import array_of, reshard, row_index, storage_array, write

__all__ = [
    # the tensor and its storage
    "TpuTensor",  # a tpu tensor: a torch.Tensor whose values are a jax.Array
    "Storage",  # the memory a base tensor and its views share
    "Layout",  # how torchtpu.distributed laid a storage out over a mesh
    "storage_of",  # a tensor's Storage
    "storage_order",  # the memory order of a storage's array
    "new_base",  # a fresh base tensor holding a jax.Array
    "new_empty",  # a fresh tensor whose memory is not written yet
    "torch_device",  # torch.device("tpu", i) of an internal device index
    "internal_index",  # the internal device index of a user's device index
    # reading and writing values
    "array_of",  # the jax.Array of a tensor's current values (through its view)
    "write",  # make an array the value of a tensor (through its view)
    "storage_array",  # the jax.Array of a whole storage
    "row_index",  # the row of its storage a view selects, if it is one
    "reshard",  # an array laid out by another sharding
    # tracing
    "tracing",  # the context in which ops call their lowerings on tracers
    "is_tracing",  # whether ops run on tracers now
    "note_mesh",  # arrays laid out over a mesh exist in this process
    # the op table
    "lower",  # register a JAX lowering of ATen overloads
    "custom",  # register a custom handler of ATen overloads
    "post",  # register a fix-up of an op's wrapped outputs
    "override_op",  # take over an op that has a lowering, keeping the lowering callable
    # the device
    "register_device",  # make "tpu" a PyTorch device (import torchtpu does it)
    "device_memory_stats",  # a device's memory counters
    "mark_pinned",  # make a CPU tensor's is_pinned() true
    "register_dtensor_methods",  # give TpuTensor its DTensor methods (torchtpu.distributed does it)
    "CONFIG",  # the dispatcher's settings (eager mode, CPU fallback)
    "STATS",  # the eager executable cache's counters
]
